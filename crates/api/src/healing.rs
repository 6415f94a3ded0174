//! How a volume heals, as the API reports it: what its owner says of the
//! copies it brings up to date and the components it waits for
//! (`/v1/local/owners`), and the one line `shoal volume show` and `shoal
//! status` print for people.

use serde::{Deserialize, Serialize};
use shoal_model::{ComponentId, NodeId, VolumeHealth};

/// What kind of copy a resync fills.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ResyncKind {
    /// A component a change of layout added (a rebuild of a lost copy).
    Rebuild,
    /// A copy of the layout coming back, catching up.
    Resync,
}

/// One copy being brought up to date, as its owner reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResyncReport {
    /// The component being filled.
    pub component: ComponentId,
    pub kind: ResyncKind,
    /// Bytes to copy in all (0 until the owner knows its plan).
    pub bytes_to_copy: u64,
    /// Bytes copied so far.
    pub bytes_copied: u64,
    /// Bytes copied per second so far.
    pub rate_bytes_per_s: u64,
    /// Seconds left at that rate; None before the first bytes.
    pub eta_s: Option<u64>,
}

impl ResyncReport {
    /// Bytes still to copy.
    pub fn bytes_left(&self) -> u64 {
        self.bytes_to_copy.saturating_sub(self.bytes_copied)
    }
}

/// A component out of service whose rebuild waits for the repair delay.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WaitingComponent {
    pub component: ComponentId,
    /// Seconds left before it is rebuilt elsewhere.
    pub left_s: u64,
}

/// The healing of one volume, as its owner sees it now.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealingReport {
    pub volume: String,
    /// The owner that reports.
    pub node: NodeId,
    /// The copy being brought up to date, if any.
    pub resync: Option<ResyncReport>,
    /// Why the layout is changing (a rebuild in progress), if it is.
    pub change: Option<String>,
    /// Components waiting for the repair delay.
    #[serde(default)]
    pub waiting: Vec<WaitingComponent>,
    /// Why the lost components cannot be rebuilt now.
    pub cannot_rebuild: Option<String>,
}

/// What stands in for the owner's details when it did not answer (or the
/// volume has no owner).
pub const OWNER_NOT_REACHABLE: &str = "owner not reachable";

/// One line for people on how the volume heals: its health and, when it
/// is not healthy, what its owner is doing about it (`healing`: the
/// owner's report, None when it did not answer or there is no owner).
///
/// The directory's health leads: on a volume it calls healthy, a change
/// or a resync in the owner's report is a moment old (the directory
/// records both in the components' states), and only what the owner
/// alone knows is said: components it waits to rebuild (a witness that
/// stopped answering on a host that still heartbeats) or cannot rebuild.
pub fn healing_text(health: VolumeHealth, healing: Option<&HealingReport>) -> String {
    let detail = match (health, healing) {
        (VolumeHealth::Inaccessible, _) => return "inaccessible".into(),
        (VolumeHealth::Healthy, None) => None,
        (VolumeHealth::Healthy, Some(h)) => lost_detail(h),
        (VolumeHealth::ReducedAvailability, None) => Some(OWNER_NOT_REACHABLE.to_string()),
        (VolumeHealth::ReducedAvailability, Some(h)) => healing_detail(h),
    };
    match (detail, health) {
        (Some(d), _) => format!("reduced availability: {d}"),
        (None, VolumeHealth::Healthy) => "healthy".into(),
        (None, _) => "reduced availability".into(),
    }
}

/// The owner's work, most telling first: a change of layout, then what
/// [`lost_detail`] says, then a resync.
fn healing_detail(h: &HealingReport) -> Option<String> {
    if let Some(reason) = &h.change {
        // A rebuild restores protection; any other change (a policy
        // change, a move for maintenance or a device removal) reshapes it.
        let what = if reason.starts_with("rebuild") {
            "rebuilding"
        } else {
            "changing layout"
        };
        return Some(format!("{what} ({reason})"));
    }
    lost_detail(h).or_else(|| h.resync.as_ref().map(|_| "resyncing".to_string()))
}

/// Lost components not being rebuilt yet: they cannot be, or they wait
/// for the repair delay (the soonest one's time left).
fn lost_detail(h: &HealingReport) -> Option<String> {
    if let Some(why) = &h.cannot_rebuild {
        return Some(format!("cannot rebuild ({why})"));
    }
    let left = h.waiting.iter().map(|w| w.left_s).min()?;
    Some(format!("waiting for the repair delay ({left} s left)"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use VolumeHealth::{Healthy, Inaccessible, ReducedAvailability as Reduced};

    fn resync(kind: ResyncKind) -> ResyncReport {
        ResyncReport {
            component: 7,
            kind,
            bytes_to_copy: 100 << 20,
            bytes_copied: 20 << 20,
            rate_bytes_per_s: 10 << 20,
            eta_s: Some(8),
        }
    }

    fn report() -> HealingReport {
        HealingReport {
            volume: "v".into(),
            node: 1,
            ..HealingReport::default()
        }
    }

    #[test]
    fn a_healthy_volume_says_so_with_or_without_its_owner() {
        assert_eq!(healing_text(Healthy, None), "healthy");
        assert_eq!(healing_text(Healthy, Some(&report())), "healthy");
        // A report a moment older than the commit that made it healthy.
        let mut h = report();
        h.change = Some("rebuild of component 7".into());
        h.resync = Some(resync(ResyncKind::Rebuild));
        assert_eq!(healing_text(Healthy, Some(&h)), "healthy");
    }

    #[test]
    fn inaccessible_is_said_whatever_the_owner_does() {
        let mut h = report();
        h.change = Some("rebuild of component 7".into());
        assert_eq!(healing_text(Inaccessible, Some(&h)), "inaccessible");
        assert_eq!(healing_text(Inaccessible, None), "inaccessible");
    }

    #[test]
    fn without_the_owner_only_the_directory_speaks() {
        assert_eq!(
            healing_text(Reduced, None),
            "reduced availability: owner not reachable"
        );
        assert_eq!(
            healing_text(Reduced, Some(&report())),
            "reduced availability"
        );
    }

    #[test]
    fn each_kind_of_work_has_its_words() {
        let mut h = report();
        h.resync = Some(resync(ResyncKind::Resync));
        assert_eq!(
            healing_text(Reduced, Some(&h)),
            "reduced availability: resyncing"
        );
        h.waiting = vec![
            WaitingComponent {
                component: 3,
                left_s: 40,
            },
            WaitingComponent {
                component: 4,
                left_s: 12,
            },
        ];
        assert_eq!(
            healing_text(Reduced, Some(&h)),
            "reduced availability: waiting for the repair delay (12 s left)"
        );
        h.cannot_rebuild = Some("no fault domain left".into());
        assert_eq!(
            healing_text(Reduced, Some(&h)),
            "reduced availability: cannot rebuild (no fault domain left)"
        );
        h.change = Some("rebuild of component 3".into());
        assert_eq!(
            healing_text(Reduced, Some(&h)),
            "reduced availability: rebuilding (rebuild of component 3)"
        );
        h.change = Some("policy raid1 ftt=2".into());
        assert_eq!(
            healing_text(Reduced, Some(&h)),
            "reduced availability: changing layout (policy raid1 ftt=2)"
        );
    }

    /// The owner's work shows even when the directory has nothing against
    /// the volume yet (a witness that stopped answering on a host that
    /// still heartbeats).
    #[test]
    fn the_owners_work_shows_on_a_volume_the_directory_calls_healthy() {
        let mut h = report();
        h.waiting = vec![WaitingComponent {
            component: 3,
            left_s: 5,
        }];
        assert_eq!(
            healing_text(Healthy, Some(&h)),
            "reduced availability: waiting for the repair delay (5 s left)"
        );
        h.cannot_rebuild = Some("no space".into());
        assert_eq!(
            healing_text(Healthy, Some(&h)),
            "reduced availability: cannot rebuild (no space)"
        );
    }

    #[test]
    fn a_resync_reads_as_the_api_documents_it() {
        let json = serde_json::to_value(resync(ResyncKind::Rebuild)).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "component": 7,
                "kind": "rebuild",
                "bytes_to_copy": 100u64 << 20,
                "bytes_copied": 20u64 << 20,
                "rate_bytes_per_s": 10u64 << 20,
                "eta_s": 8,
            })
        );
        let mut r = resync(ResyncKind::Resync);
        r.eta_s = None;
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["kind"], "resync");
        assert!(json["eta_s"].is_null(), "{json}");
        assert_eq!(r.bytes_left(), 80 << 20);
    }
}
