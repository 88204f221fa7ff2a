//! Channels (`stable`, `rapid`, …) and the Kubernetes versions they resolve to, from
//! `channels.yaml` at the repository root (compiled in).

/// The channels file as shipped.
pub const CHANNELS_YAML: &str = include_str!("../../../channels.yaml");

/// `(channel, version)` pairs of a channels file: the `name: version` lines under
/// `channels:`; comments and blank lines are ignored.
pub fn parse(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut inside = false;
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or_default().trim_end();
        if line.trim().is_empty() {
            continue;
        }
        if !line.starts_with(' ') {
            inside = line.trim() == "channels:";
            continue;
        }
        if !inside {
            continue;
        }
        if let Some((k, v)) = line.trim().split_once(':') {
            let v = v.trim().trim_matches('"');
            if !k.trim().is_empty() && !v.is_empty() {
                out.push((k.trim().to_string(), v.to_string()));
            }
        }
    }
    out
}

/// Every shipped channel, in file order.
pub fn all() -> Vec<(String, String)> {
    parse(CHANNELS_YAML)
}

/// The version channel `name` resolves to.
pub fn resolve(name: &str) -> Option<String> {
    all().into_iter().find(|(n, _)| n == name).map(|(_, v)| v)
}
