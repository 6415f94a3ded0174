//! What volumes take on the devices, for the API's capacity figures
//! (`shoal volume show`, `shoal status`): each component's written bytes
//! asked of its node ([`shoal_rpc::Request::Usage`], a counter read), all
//! at once, each bounded in time. Owns nothing; changes nothing.

use crate::router::Router;
use futures::stream::{self, StreamExt};
use shoal_api::CapacityReport;
use shoal_directory::ClusterState;
use shoal_model::{ComponentId, ComponentRole, NodeState, Volume};
use std::collections::BTreeMap;
use std::time::Duration;

/// Components asked at the same time: a status of many volumes does not
/// open a burst of requests on every node at once.
const USAGE_ASKS_IN_FLIGHT: usize = 32;
/// How long one component's node may take to answer, in milliseconds: a
/// report goes out without that figure after it.
const USAGE_TIMEOUT_MS: u64 = 2000;

/// The capacity of each of `vs`, in order. `written_of` gives what the
/// owner of an erasure-coded volume told of its written bytes (by name);
/// a RAID-1 volume's are its fullest data copy's.
pub async fn measure(
    router: &Router,
    state: &ClusterState,
    vs: &[&Volume],
    written_of: impl Fn(&str) -> Option<u64>,
) -> Vec<CapacityReport> {
    let asks: Vec<(ComponentId, String)> = vs
        .iter()
        .flat_map(|v| &v.components)
        .filter_map(|c| {
            let n = state.nodes.get(&c.node)?;
            (n.state == NodeState::Up).then(|| (c.id, n.peer_addr.clone()))
        })
        .collect();
    let used: BTreeMap<ComponentId, u64> = stream::iter(asks)
        .map(|(id, addr)| async move {
            let r = tokio::time::timeout(
                Duration::from_millis(USAGE_TIMEOUT_MS),
                router.usage(&addr, id),
            )
            .await;
            (id, r.ok().and_then(Result::ok))
        })
        .buffer_unordered(USAGE_ASKS_IN_FLIGHT)
        .filter_map(|(id, r)| async move { r.map(|b| (id, b)) })
        .collect()
        .await;
    vs.iter()
        .map(|v| of_volume(v, &used, written_of(&v.name)))
        .collect()
}

/// One volume's figures from its components' answers.
fn of_volume(
    v: &Volume,
    used: &BTreeMap<ComponentId, u64>,
    owner_written: Option<u64>,
) -> CapacityReport {
    let used_bytes = v
        .components
        .iter()
        .map(|c| used.get(&c.id).copied())
        .sum::<Option<u64>>();
    let written_bytes = match v.stripe {
        Some(_) => owner_written,
        None => v
            .components
            .iter()
            .filter(|c| c.role == ComponentRole::Data)
            .filter_map(|c| used.get(&c.id))
            .max()
            .map(|&b| b.min(v.size)),
    };
    CapacityReport {
        size_bytes: v.size,
        written_bytes,
        used_bytes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_model::{Component, ComponentState, StripeGeometry};

    fn volume(stripe: Option<StripeGeometry>, components: Vec<Component>) -> Volume {
        Volume {
            id: 1,
            name: "v".into(),
            size: 100,
            policy: Default::default(),
            components,
            owner: None,
            generation: 0,
            problem: None,
            wrapped_key: None,
            wanted_policy: None,
            grow_to: None,
            map_log_at: None,
            reconfig: None,
            stripe,
        }
    }

    fn comp(id: u64, role: ComponentRole) -> Component {
        Component {
            id,
            role,
            node: id,
            device: id,
            state: ComponentState::Active,
            votes: 1,
        }
    }

    #[test]
    fn raid1_written_is_the_fullest_copy_and_used_every_component() {
        let v = volume(
            None,
            vec![
                comp(1, ComponentRole::Data),
                comp(2, ComponentRole::Data),
                comp(3, ComponentRole::Witness),
            ],
        );
        let used: BTreeMap<u64, u64> = [(1, 60), (2, 50), (3, 0)].into();
        let r = of_volume(&v, &used, Some(7));
        assert_eq!((r.written_bytes, r.used_bytes), (Some(60), Some(110)));
        assert_eq!(r.overhead().map(|o| (o * 100.0).round()), Some(183.0));
        // A component that did not answer: used is unknown.
        let used: BTreeMap<u64, u64> = [(1, 60), (3, 0)].into();
        assert_eq!(of_volume(&v, &used, None).used_bytes, None);
        // A copy's bytes past the volume's end are not written data.
        let used: BTreeMap<u64, u64> = [(1, 160), (2, 160), (3, 0)].into();
        assert_eq!(of_volume(&v, &used, None).written_bytes, Some(100));
    }

    #[test]
    fn erasure_written_is_the_owners_word() {
        let v = volume(
            Some(StripeGeometry::RAID5_NARROW),
            vec![comp(1, ComponentRole::Data)],
        );
        let used: BTreeMap<u64, u64> = [(1, 40)].into();
        assert_eq!(of_volume(&v, &used, Some(90)).written_bytes, Some(90));
        assert_eq!(of_volume(&v, &used, None).written_bytes, None);
    }
}
