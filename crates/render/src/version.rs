//! Kubernetes versions and the etcd version paired with each.

use std::fmt;
use std::str::FromStr;

use crate::RenderError;

/// Lowest supported Kubernetes minor (1.20).
pub const MIN_SUPPORTED_MINOR: u32 = 20;
/// Highest supported Kubernetes minor (1.34).
pub const MAX_SUPPORTED_MINOR: u32 = 34;

/// A Kubernetes release `MAJOR.MINOR.PATCH`, always within the supported range once parsed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KubeVersion {
    /// Major version (always 1).
    pub major: u32,
    /// Minor version (20 through 34).
    pub minor: u32,
    /// Patch version.
    pub patch: u32,
}

impl KubeVersion {
    /// A version from its parts (not checked; [`KubeVersion::check_supported`] checks it).
    pub const fn new(major: u32, minor: u32, patch: u32) -> Self {
        KubeVersion {
            major,
            minor,
            patch,
        }
    }

    /// Parse `1.20.2` or `v1.20.2`; fails on anything else and on versions outside
    /// [`MIN_SUPPORTED_MINOR`]..=[`MAX_SUPPORTED_MINOR`] of major 1.
    pub fn parse(s: &str) -> Result<Self, RenderError> {
        let invalid = |reason: &str| RenderError::InvalidVersion {
            input: s.to_string(),
            reason: reason.to_string(),
        };
        let trimmed = s.trim();
        if trimmed.is_empty() {
            return Err(invalid("it is empty"));
        }
        let body = trimmed.strip_prefix('v').unwrap_or(trimmed);
        let parts: Vec<&str> = body.split('.').collect();
        if parts.len() != 3 {
            return Err(invalid(&format!(
                "it has {} dot-separated parts, not 3",
                parts.len()
            )));
        }
        let mut nums = [0u32; 3];
        for (slot, (part, what)) in nums
            .iter_mut()
            .zip(parts.iter().zip(["major", "minor", "patch"]))
        {
            if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
                return Err(invalid(&format!(
                    "the {what} part {part:?} is not a number (pre-releases and build suffixes are not accepted)"
                )));
            }
            *slot = part
                .parse()
                .map_err(|_| invalid(&format!("the {what} part {part:?} is too large")))?;
        }
        let v = KubeVersion::new(nums[0], nums[1], nums[2]);
        v.check_supported()?;
        Ok(v)
    }

    /// Whether this version is within the supported range.
    pub fn is_supported(&self) -> bool {
        self.major == 1 && (MIN_SUPPORTED_MINOR..=MAX_SUPPORTED_MINOR).contains(&self.minor)
    }

    /// `Ok` when the version is supported, else [`RenderError::UnsupportedVersion`].
    pub fn check_supported(&self) -> Result<(), RenderError> {
        if self.is_supported() {
            Ok(())
        } else {
            Err(RenderError::UnsupportedVersion {
                version: self.to_string(),
                min: MIN_SUPPORTED_MINOR,
                max: MAX_SUPPORTED_MINOR,
            })
        }
    }

    /// Whether this version is at least `1.<minor>`.
    pub fn at_least(&self, minor: u32) -> bool {
        self.major > 1 || (self.major == 1 && self.minor >= minor)
    }
}

impl fmt::Display for KubeVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "v{}.{}.{}", self.major, self.minor, self.patch)
    }
}

impl FromStr for KubeVersion {
    type Err = RenderError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        KubeVersion::parse(s)
    }
}

/// The etcd image tag kubeadm pairs with a Kubernetes minor (the default of that minor's first
/// kubeadm release; `registry.k8s.io/etcd:<tag>`). Versions outside the supported range get
/// the nearest supported minor's etcd.
pub fn etcd_version_for(v: &KubeVersion) -> &'static str {
    let minor = if v.major != 1 || v.minor > MAX_SUPPORTED_MINOR {
        MAX_SUPPORTED_MINOR
    } else {
        v.minor.max(MIN_SUPPORTED_MINOR)
    };
    match minor {
        ..=21 => "3.4.13-0",
        22 => "3.5.0-0",
        23 => "3.5.1-0",
        24 => "3.5.3-0",
        25 => "3.5.4-0",
        26 => "3.5.6-0",
        27 => "3.5.7-0",
        28 => "3.5.9-0",
        29 => "3.5.10-0",
        30 => "3.5.12-0",
        31 => "3.5.15-0",
        32 => "3.5.16-0",
        33 => "3.5.21-0",
        _ => "3.6.4-0",
    }
}

/// The etcd minor (4, 5, 6 for 3.4, 3.5, 3.6) paired with `v`.
pub(crate) fn etcd_minor_for(v: &KubeVersion) -> u32 {
    etcd_version_for(v)
        .split('.')
        .nth(1)
        .and_then(|m| m.parse().ok())
        .unwrap_or(4)
}
