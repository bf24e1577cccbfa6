//! Remote images (`http(s)://` URLs in chat `image_url` parts), fetched only where
//! `limits.imageUrlHosts` allows: the URL parsed by the `url` crate (the parser reqwest connects
//! by, so the host checked is the host reached), its host and port matched against the list, its
//! addresses resolved once, refused when not global (private, loopback, link-local, multicast,
//! ... unless `limits.imageUrlAllowPrivate`), and connected to exactly those addresses (no second
//! lookup that DNS rebinding could answer otherwise), with no redirect followed and no proxy.
//! Fetch failures are one code whose message does not carry the remote's answer.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use axum::http::StatusCode;
use mole_api::WorkerLimits;
use url::{Host, Url};

use crate::error::bad;
use crate::ApiError;

/// Longest a connection to an image host may take to open.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest a whole image fetch (lookup, connect, headers, body) may take.
pub(crate) const FETCH_TIMEOUT: Duration = Duration::from_secs(30);

fn not_allowed(field: &str, why: impl std::fmt::Display) -> ApiError {
    bad(
        "image_url_not_allowed",
        format!(
            "{field}: {why}; remote image URLs are fetched only from limits.imageUrlHosts \
             (send the image as a data: URL or base64 instead)"
        ),
    )
}

/// A host and port of `limits.imageUrlHosts` (`name`, `name:port`, an IP literal, `[v6]:port`),
/// read by the same parser as the URLs; `None` when the entry is not one.
fn entry(e: &str) -> Option<(String, Option<u16>)> {
    let u = Url::parse(&format!("http://{}/", e.trim())).ok()?;
    if u.path() != "/" || !u.username().is_empty() || u.password().is_some() {
        return None;
    }
    let host = u.host_str()?.trim_end_matches('.').to_ascii_lowercase();
    // `http://` makes `:80` the default, so an entry that names port 80 keeps it.
    let port = u.port().or_else(|| e.trim().ends_with(":80").then_some(80));
    Some((host, port))
}

/// An `http(s)://` image URL as a request sends it, checked against `limits.imageUrlHosts`:
/// parsed as reqwest will, no credentials, its host listed, its port the scheme's default
/// unless the entry names that port.
pub(crate) fn parse_allowed(
    value: &str,
    field: &str,
    limits: &WorkerLimits,
) -> Result<Url, ApiError> {
    let url = Url::parse(value)
        .map_err(|e| bad("invalid_image", format!("{field} is not a valid URL: {e}")))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(not_allowed(field, "only http and https URLs are fetched"));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(not_allowed(field, "URLs with credentials are not fetched"));
    }
    let Some(host) = url.host_str() else {
        return Err(not_allowed(field, "the URL has no host"));
    };
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    let listed: Vec<(String, Option<u16>)> = limits
        .image_url_hosts
        .iter()
        .filter_map(|e| entry(e))
        .filter(|(h, _)| *h == host)
        .collect();
    if listed.is_empty() {
        return Err(not_allowed(field, format!("host {host:?} is not listed")));
    }
    let port = url.port_or_known_default();
    let port_ok = listed.iter().any(|(_, p)| match p {
        Some(p) => Some(*p) == port,
        None => url.port().is_none(),
    });
    if !port_ok {
        return Err(not_allowed(
            field,
            format!(
                "port {} of {host:?} is not listed (only the scheme's default port unless the \
                 entry names one, as host:port)",
                port.unwrap_or_default()
            ),
        ));
    }
    Ok(url)
}

/// Whether `ip` is a global unicast address: not unspecified, loopback, private (RFC 1918,
/// unique-local), shared (CGNAT), link-local, multicast, broadcast, documentation,
/// benchmarking or reserved; IPv4-mapped, IPv4-compatible, NAT64 and 6to4 IPv6 addresses are
/// judged by the IPv4 address they carry.
pub fn is_global(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => is_global_v4(v4),
        IpAddr::V6(v6) => is_global_v6(v6),
    }
}

fn is_global_v4(ip: Ipv4Addr) -> bool {
    let [a, b, c, _] = ip.octets();
    !(a == 0 // "this network", unspecified
        || a == 10
        || a == 127
        || (a == 100 && (64..128).contains(&b)) // shared address space (CGNAT)
        || (a == 169 && b == 254)
        || (a == 172 && (16..32).contains(&b))
        || (a == 192 && b == 0 && c == 0) // IETF protocol assignments
        || (a == 192 && b == 0 && c == 2) // TEST-NET-1
        || (a == 192 && b == 88 && c == 99) // 6to4 relay anycast
        || (a == 192 && b == 168)
        || (a == 198 && (18..20).contains(&b)) // benchmarking
        || (a == 198 && b == 51 && c == 100) // TEST-NET-2
        || (a == 203 && b == 0 && c == 113) // TEST-NET-3
        || a >= 224) // multicast, reserved, broadcast
}

fn is_global_v6(ip: Ipv6Addr) -> bool {
    let s = ip.segments();
    let embedded = |hi: usize| {
        Ipv4Addr::new(
            (s[hi] >> 8) as u8,
            s[hi] as u8,
            (s[hi + 1] >> 8) as u8,
            s[hi + 1] as u8,
        )
    };
    if ip.is_unspecified() || ip.is_loopback() {
        return false;
    }
    // ::ffff:a.b.c.d (mapped) and ::a.b.c.d (the deprecated compatible form).
    if s[..5] == [0; 5] && (s[5] == 0xffff || s[5] == 0) {
        return is_global_v4(embedded(6));
    }
    // NAT64 64:ff9b::/96 reaches the IPv4 address it carries.
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        return is_global_v4(embedded(6));
    }
    // 6to4 2002::/16 carries an IPv4 address in its next 32 bits.
    if s[0] == 0x2002 {
        return is_global_v4(embedded(1));
    }
    !((s[0] & 0xfe00) == 0xfc00 // unique local
        || (s[0] & 0xffc0) == 0xfe80 // link-local
        || (s[0] & 0xffc0) == 0xfec0 // site-local (deprecated)
        || (s[0] & 0xff00) == 0xff00 // multicast
        || (s[0] == 0x2001 && s[1] == 0x0db8) // documentation
        || (s[0] == 0x2001 && s[1] < 0x0200) // IETF protocol assignments, Teredo
        || (s[0] == 0x0100 && s[1..4] == [0, 0, 0]) // discard-only
        || s[0] == 0) // the rest of ::/16 (reserved)
}

/// GETs an image URL that [`parse_allowed`] passed: its addresses resolved and checked, then
/// connected to as checked; no redirect followed, no proxy, `maxImageBytes` read at most,
/// [`FETCH_TIMEOUT`] in all. The caller's `field` names it in errors.
pub(crate) async fn fetch(
    url: &Url,
    field: &str,
    limits: &WorkerLimits,
) -> Result<Vec<u8>, ApiError> {
    match tokio::time::timeout(FETCH_TIMEOUT, fetch_checked(url, field, limits)).await {
        Ok(r) => r,
        Err(_) => Err(failed(field, url, "timed out")),
    }
}

/// The one answer to a fetch that failed: the remote's status and errors are logged, not sent
/// back (they would make the worker a probe of what it can reach).
fn failed(field: &str, url: &Url, detail: impl std::fmt::Display) -> ApiError {
    tracing::warn!(%url, "image fetch failed: {detail}");
    bad(
        "image_fetch_failed",
        format!("{field}: the image could not be fetched"),
    )
}

async fn fetch_checked(url: &Url, field: &str, limits: &WorkerLimits) -> Result<Vec<u8>, ApiError> {
    let port = url.port_or_known_default().unwrap_or(80);
    let (domain, addrs): (Option<&str>, Vec<SocketAddr>) = match url.host() {
        Some(Host::Ipv4(ip)) => (None, vec![SocketAddr::new(ip.into(), port)]),
        Some(Host::Ipv6(ip)) => (None, vec![SocketAddr::new(ip.into(), port)]),
        Some(Host::Domain(d)) => {
            let found = tokio::net::lookup_host((d, port))
                .await
                .map_err(|e| failed(field, url, format!("resolving {d}: {e}")))?;
            (Some(d), found.collect())
        }
        None => return Err(not_allowed(field, "the URL has no host")),
    };
    if addrs.is_empty() {
        return Err(failed(field, url, "no address"));
    }
    // Every address must pass: a name that resolves to a public and a private address is
    // refused rather than raced.
    if !limits.image_url_allow_private {
        if let Some(a) = addrs.iter().find(|a| !is_global(a.ip())) {
            return Err(not_allowed(
                field,
                format!(
                    "its host resolves to {}, which is not a public address \
                     (limits.imageUrlAllowPrivate is off)",
                    a.ip()
                ),
            ));
        }
    }
    let mut client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .connect_timeout(CONNECT_TIMEOUT)
        .timeout(FETCH_TIMEOUT);
    if let Some(d) = domain {
        client = client.resolve_to_addrs(d, &addrs);
    }
    let client = client
        .build()
        .map_err(|e| failed(field, url, format!("client: {e}")))?;
    let mut resp = client
        .get(url.clone())
        .send()
        .await
        .map_err(|e| failed(field, url, e))?;
    if !resp.status().is_success() {
        // A redirect too: following it would reach a host nobody checked.
        return Err(failed(field, url, format!("HTTP {}", resp.status())));
    }
    if resp
        .content_length()
        .is_some_and(|n| n > limits.max_image_bytes)
    {
        return Err(too_large(field, limits));
    }
    let mut out = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(|e| failed(field, url, e))? {
        out.extend_from_slice(&chunk);
        if out.len() as u64 > limits.max_image_bytes {
            return Err(too_large(field, limits));
        }
    }
    Ok(out)
}

fn too_large(field: &str, limits: &WorkerLimits) -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "image_too_large",
        format!(
            "{field}: the image exceeds limits.maxImageBytes ({} bytes)",
            limits.max_image_bytes
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(hosts: &[&str]) -> WorkerLimits {
        WorkerLimits {
            image_url_hosts: hosts.iter().map(|h| h.to_string()).collect(),
            ..WorkerLimits::default()
        }
    }

    #[test]
    fn urls_are_matched_by_the_host_and_port_the_client_connects_to() {
        let l = limits(&["img.example.com", "cdn.example.com:8443", "10.1.2.3"]);
        let code = |u: &str| parse_allowed(u, "f", &l).err().map(|e| e.code);
        assert_eq!(code("https://img.example.com/a.png"), None);
        assert_eq!(code("http://IMG.example.com./a.png"), None);
        assert_eq!(code("https://cdn.example.com:8443/a.png"), None);
        assert_eq!(code("http://10.1.2.3/a.png"), None);
        // The hex form of a listed IP literal is that literal.
        assert_eq!(code("http://0x0a010203/a.png"), None);
        for refused in [
            // The url crate ends an http authority at `\`: the host is 169.254.169.254.
            r"http://169.254.169.254\@img.example.com/x",
            "http://169.254.169.254#@img.example.com/x",
            "http://img.example.com@169.254.169.254/x",
            "http://user:pw@img.example.com/x",
            "http://img.example.com:8080/x",
            "https://cdn.example.com/x",
            "ftp://img.example.com/x",
            "http://img.example.com.evil.org/x",
        ] {
            assert_eq!(code(refused), Some("image_url_not_allowed"), "{refused}");
        }
        assert_eq!(code("http://["), Some("invalid_image"));
    }

    #[test]
    fn only_global_addresses_pass() {
        for a in [
            "0.0.0.0",
            "10.0.0.1",
            "100.64.0.1",
            "127.0.0.1",
            "169.254.169.254",
            "172.16.0.1",
            "192.168.1.1",
            "224.0.0.1",
            "255.255.255.255",
            "::",
            "::1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "::127.0.0.1",
            "64:ff9b::a9fe:a9fe",
            "2002:7f00:1::",
            "fc00::1",
            "fd00:ec2::254",
            "fe80::1",
            "ff02::1",
            "2001:db8::1",
        ] {
            assert!(!is_global(a.parse().unwrap()), "{a}");
        }
        for a in ["8.8.8.8", "1.1.1.1", "2606:4700::1111", "::ffff:8.8.8.8"] {
            assert!(is_global(a.parse().unwrap()), "{a}");
        }
    }
}
