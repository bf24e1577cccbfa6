use super::trace::{generate, Request, TraceSpec};
use super::*;

#[test]
fn the_service_model_reproduces_the_measured_figures() {
    let m = ServiceModel::default();
    assert!((m.merged_rate(1) - 74.1).abs() < 1e-9);
    assert!((m.merged_rate(16) - 193.9).abs() < 1e-9);
    assert!((m.dynamic_rate(1, 1) / m.merged_rate(1) - 0.50).abs() < 1e-9);
    assert!((m.dynamic_rate(16, 1) / m.merged_rate(16) - 0.95).abs() < 1e-9);
    assert!((m.dynamic_rate(16, 16) / m.dynamic_rate(16, 1) - 0.23).abs() < 1e-9);
    // More distinct adapters never make a batch faster.
    for k in 1..16 {
        assert!(m.dynamic_rate(16, k + 1) < m.dynamic_rate(16, k));
    }
}

/// One hot adapter for 40 minutes, then silence from it while the others go on.
fn hot_then_cold() -> Vec<Request> {
    let mut out = Vec::new();
    let mut t = 0.0;
    let mut i: u32 = 0;
    while t < 4800.0 {
        if t < 2400.0 {
            out.push(Request {
                at: t,
                adapter: 0,
                tokens: 64,
            });
        }
        out.push(Request {
            at: t + 0.25,
            adapter: 1 + i % 19,
            tokens: 64,
        });
        i += 1;
        t += 1.0;
    }
    out
}

#[test]
fn the_traffic_policy_promotes_a_hot_adapter_and_demotes_it_when_it_cools() {
    let cfg = SimConfig::new(4);
    let trace = hot_then_cold();
    let o = run(Strategy::Traffic, &cfg, &trace, 20).unwrap();
    assert_eq!(o.completed, trace.len(), "every request served");
    assert_eq!(o.promotions, 1, "{:#?}", o.events);
    assert_eq!(o.demotions, 1, "{:#?}", o.events);
    assert!(
        o.events[0].contains("adapter-0 TrafficPromoted"),
        "{}",
        o.events[0]
    );
    assert!(
        o.events[1].contains("adapter-0 TrafficDemoted"),
        "{}",
        o.events[1]
    );
    assert!(o.served[0] > 0.2, "a share served merged: {:?}", o.served);
    // A merged pod served while it was hot, none at the end.
    assert!(o.timeline.iter().any(|m| m.merged_pods == 1));
    assert_eq!(o.timeline.last().unwrap().merged_pods, 0);
    // Deterministic.
    assert_eq!(run(Strategy::Traffic, &cfg, &trace, 20).unwrap(), o);
}

#[test]
fn static_policies_serve_everything_and_all_merged_takes_a_gpu_per_adapter() {
    let cfg = SimConfig::new(4);
    let trace = generate(&TraceSpec {
        adapters: 20,
        duration_s: 600.0,
        rate: 0.5,
        bursts: 1,
        burst_s: 60.0,
        ..TraceSpec::default()
    });
    for s in [
        Strategy::AllDynamic,
        Strategy::DynamicPlaced,
        Strategy::AllMerged,
    ] {
        let o = run(s, &cfg, &trace, 20).unwrap();
        assert_eq!(o.completed, trace.len(), "{}", s.name());
        assert_eq!(o.promotions + o.demotions, 0);
        let total: f64 = o.served.iter().sum();
        assert!((total - 1.0).abs() < 1e-9);
        if s == Strategy::AllMerged {
            assert_eq!((o.gpus, o.served[0]), (20, 1.0));
        } else {
            assert_eq!((o.gpus, o.served[0]), (4, 0.0));
        }
    }
    let table = report::table(&[run(Strategy::AllDynamic, &cfg, &trace, 20).unwrap()]);
    assert!(table.contains("| all-dynamic | 4 |"), "{table}");
}

#[test]
fn settings_out_of_range_are_refused() {
    let mut cfg = SimConfig::new(4);
    cfg.min_dynamic = 5;
    assert!(run(Strategy::Traffic, &cfg, &[], 1).is_err());
    let mut cfg = SimConfig::new(4);
    cfg.merge.demote_share = cfg.merge.promote_share;
    assert!(run(Strategy::Traffic, &cfg, &[], 1).is_err());
}
