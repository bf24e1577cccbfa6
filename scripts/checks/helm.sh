#!/usr/bin/env bash
# The Helm chart: lint (strict), render with default values and with every optional part on,
# check every rendered built-in object against the Kubernetes schemas offline, and check that
# the CRDs in charts/mole/crds parse as CustomResourceDefinitions.
set -euo pipefail
cd "$(dirname "$0")/../.."
MOLE_CACHE="${MOLE_CACHE:-$HOME/.cache/mole}"
bin=$(bash scripts/tools.sh)
helm="$bin/helm"
validate="$MOLE_CACHE/venv/bin/kubernetes-validate"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

"$helm" lint --strict charts/mole
"$helm" template mole charts/mole --namespace mole-system > "$out/default.yaml"
"$helm" template mole charts/mole --namespace mole-system \
  --set metrics.serviceMonitor.enabled=true --set watchNamespace=ml \
  --set autoscaling.prometheusAdapter.enabled=true --set autoscaling.podMonitor.enabled=true \
  --set leaderElection.enabled=false > "$out/all.yaml"
# A value the schema forbids must be refused.
if "$helm" template mole charts/mole --set replicaCount=-1 > /dev/null 2>&1; then
  echo "values.schema.json accepted replicaCount=-1" >&2
  exit 1
fi
# Built-in kinds against the bundled schemas (the ServiceMonitor custom kind only warns).
"$validate" --strict --kubernetes-version 1.33 "$out/default.yaml"
"$validate" --kubernetes-version 1.33 "$out/all.yaml"
"$validate" --strict --kubernetes-version 1.33 charts/mole/crds/*.yaml
kinds=$(grep -h '^kind:' "$out/default.yaml" | sort | uniq -c | tr -s ' ')
echo "rendered:$kinds"
for k in Deployment ServiceAccount ClusterRole ClusterRoleBinding Role RoleBinding Service; do
  grep -q "^kind: $k$" "$out/default.yaml" || { echo "missing $k" >&2; exit 1; }
done
grep -q "^kind: ServiceMonitor$" "$out/all.yaml" || { echo "ServiceMonitor not rendered" >&2; exit 1; }
grep -q "^kind: PodMonitor$" "$out/all.yaml" || { echo "PodMonitor not rendered" >&2; exit 1; }
if grep -q "^kind: PodMonitor$\|prometheus-adapter" "$out/default.yaml"; then
  echo "autoscaling parts rendered by default" >&2; exit 1
fi
# The prometheus-adapter ConfigMap holds a config.yaml that parses, with the rule for the
# workers' queue gauge the operator's HPAs name (operator/src/resources/hpa.rs).
"$MOLE_CACHE/venv/bin/python" - "$out/all.yaml" <<'PY'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
cm = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "mole-operator-prometheus-adapter"]
assert cm, "no ConfigMap mole-operator-prometheus-adapter"
rules = yaml.safe_load(cm[0]["data"]["config.yaml"])["rules"]
assert any(r["name"]["as"] == "mole_requests_waiting" and "<<.LabelMatchers>>" in r["metricsQuery"]
           and r["resources"]["overrides"]["pod"] == {"resource": "pod"} for r in rules), rules
PY
# With watchNamespace the operator's role is bound in that namespace only.
if grep -q "^kind: ClusterRoleBinding$" "$out/all.yaml"; then
  echo "watchNamespace still binds the ClusterRole cluster-wide" >&2; exit 1
fi
grep -A4 "^kind: RoleBinding$" "$out/all.yaml" | grep -q "namespace: ml" \
  || { echo "watchNamespace=ml: no RoleBinding in ml" >&2; exit 1; }
echo "helm chart: lint, template, schema checks passed"
