//! The owner against in-memory replicas served over real RPC connections:
//! fan-out, marking a failed replica before the ack, resync of a returning
//! replica, and fencing by a newer owner.

use bytes::Bytes;
use shoal_model::{Component, ComponentRole, ComponentState, Generation, Policy, Volume, VolumeId};
use shoal_owner::lease::{Grants, LEASE_MS};
use shoal_owner::{
    ChangeEnd, Control, ControlError, Op, Owner, OwnerConfig, OwnerError, Target, View,
};
use shoal_rpc::{Handler, RemoteError, Reply, Request, Response};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const SIZE: u64 = 4 << 20;

/// One node's replicas, in memory.
#[derive(Default)]
struct Mem {
    comps: Mutex<HashMap<u64, (Generation, Vec<u8>)>>,
    /// Answer every request with a device error.
    broken: AtomicBool,
    /// (component, block offset) whose checksum fails on read.
    bad: Mutex<std::collections::HashSet<(u64, u64)>>,
    /// Checked writes whose data did not match the owner's CRCs.
    crc_mismatches: AtomicU64,
    /// Repairs applied.
    repairs: AtomicU64,
    /// Read requests asked (answered or failed).
    reads: AtomicU64,
    /// Requests under this generation are never answered (0: none): the
    /// owner of that generation is cut off from this replica.
    deaf_to: AtomicU64,
    /// The read leases granted, as a node's replicas keep them.
    grants: Option<Grants>,
    /// Every write applied: (component, offset, bytes).
    writes: Mutex<Vec<(u64, u64, u64)>>,
    /// Reads wait this long (milliseconds) before they read, so that
    /// writes can come in between: a slow disk.
    slow_reads_ms: AtomicU64,
    /// This replica, for answers that come later.
    me: std::sync::OnceLock<std::sync::Weak<Mem>>,
}

impl Mem {
    fn grants(&self) -> &Grants {
        self.grants.as_ref().expect("made by setup")
    }

    fn data(&self, c: u64) -> Vec<u8> {
        self.comps.lock().unwrap()[&c].1.clone()
    }

    fn wrote(&self, component: u64, offset: u64, len: usize) {
        let mut w = self.writes.lock().unwrap();
        w.push((component, offset, len as u64));
    }

    /// Bytes written to component `c` below offset `end`.
    fn written_below(&self, c: u64, end: u64) -> u64 {
        let w = self.writes.lock().unwrap();
        w.iter()
            .filter(|&&(comp, off, _)| comp == c && off < end)
            .map(|&(_, off, len)| len.min(end - off))
            .sum()
    }

    fn run(&self, req: Request, payload: Bytes) -> Result<(Response, Bytes), RemoteError> {
        if matches!(req, Request::Read { .. }) {
            self.reads.fetch_add(1, Ordering::SeqCst);
        }
        if self.broken.load(Ordering::SeqCst) {
            return Err(RemoteError::Io("injected".into()));
        }
        let mut m = self.comps.lock().unwrap();
        let mut fenced = |c: u64, g: Generation| -> Result<(), RemoteError> {
            let e = m.get_mut(&c).ok_or(RemoteError::NoSuchComponent(c))?;
            if g < e.0 {
                return Err(RemoteError::StaleGeneration { have: e.0, got: g });
            }
            e.0 = g;
            Ok(())
        };
        Ok(match req {
            Request::CreateComponent {
                component, size, ..
            } => {
                m.entry(component).or_insert((0, vec![0; size as usize]));
                (Response::Ok, Bytes::new())
            }
            // Grows only, as a node's replica.
            Request::ResizeComponent { component, size } => {
                let d = &mut m
                    .get_mut(&component)
                    .ok_or(RemoteError::NoSuchComponent(component))?
                    .1;
                if size as usize > d.len() {
                    d.resize(size as usize, 0);
                }
                (Response::Ok, Bytes::new())
            }
            Request::Activate {
                component,
                generation,
            } => {
                fenced(component, generation)?;
                let lease_ms = self
                    .grants()
                    .activate(component, generation, Instant::now());
                (
                    Response::Activated {
                        dirty: vec![],
                        lease_ms,
                    },
                    Bytes::new(),
                )
            }
            Request::Renew {
                component,
                generation,
                lease_ms,
            } => {
                let have = m
                    .get(&component)
                    .ok_or(RemoteError::NoSuchComponent(component))?
                    .0;
                // As a node's replica: older is stale, newer not activated.
                if generation < have {
                    return Err(RemoteError::StaleGeneration {
                        have,
                        got: generation,
                    });
                }
                if generation > have {
                    return Err(RemoteError::Unavailable("not activated".into()));
                }
                self.grants()
                    .grant(component, generation, lease_ms, Instant::now())
                    .map_err(|have| RemoteError::StaleGeneration {
                        have,
                        got: generation,
                    })?;
                (Response::Ok, Bytes::new())
            }
            // Keeps no tracked regions: a returning copy is copied in full.
            Request::TrackedRegions { .. } => {
                (Response::Tracked(shoal_rpc::RegionSet::All), Bytes::new())
            }
            Request::Flush {
                component,
                generation,
            }
            | Request::Track {
                component,
                generation,
                ..
            }
            | Request::Barrier {
                component,
                generation,
                ..
            } => {
                fenced(component, generation)?;
                (Response::Ok, Bytes::new())
            }
            Request::Write {
                component,
                generation,
                offset,
                ..
            } => {
                fenced(component, generation)?;
                let d = &mut m.get_mut(&component).unwrap().1;
                d[offset as usize..offset as usize + payload.len()].copy_from_slice(&payload);
                self.wrote(component, offset, payload.len());
                (Response::Ok, Bytes::new())
            }
            Request::WriteChecked {
                component,
                generation,
                offset,
                crcs,
                ..
            } => {
                fenced(component, generation)?;
                let ok = payload
                    .chunks(4096)
                    .map(crc32c::crc32c)
                    .eq(crcs.iter().copied());
                if !ok {
                    self.crc_mismatches.fetch_add(1, Ordering::SeqCst);
                    return Err(RemoteError::BadRequest("damaged in transit".into()));
                }
                let mut bad = self.bad.lock().unwrap();
                for b in (offset..offset + payload.len() as u64).step_by(4096) {
                    bad.remove(&(component, b));
                }
                let d = &mut m.get_mut(&component).unwrap().1;
                d[offset as usize..offset as usize + payload.len()].copy_from_slice(&payload);
                self.wrote(component, offset, payload.len());
                (Response::Ok, Bytes::new())
            }
            Request::Repair {
                component,
                generation,
                offset,
            } => {
                fenced(component, generation)?;
                if !self.bad.lock().unwrap().remove(&(component, offset)) {
                    return Ok((Response::Repaired(false), Bytes::new()));
                }
                self.repairs.fetch_add(1, Ordering::SeqCst);
                let d = &mut m.get_mut(&component).unwrap().1;
                d[offset as usize..offset as usize + payload.len()].copy_from_slice(&payload);
                (Response::Repaired(true), Bytes::new())
            }
            Request::WriteZeroes {
                component,
                generation,
                offset,
                len,
                ..
            } => {
                fenced(component, generation)?;
                let d = &mut m.get_mut(&component).unwrap().1;
                d[offset as usize..(offset + len) as usize].fill(0);
                (Response::Ok, Bytes::new())
            }
            Request::TrimRanges {
                component,
                generation,
                ranges,
                ..
            } => {
                fenced(component, generation)?;
                let d = &mut m.get_mut(&component).unwrap().1;
                for (offset, len) in ranges {
                    d[offset as usize..(offset + len) as usize].fill(0);
                }
                (Response::Ok, Bytes::new())
            }
            Request::Read {
                component,
                generation,
                offset,
                len,
            } => {
                fenced(component, generation)?;
                let first = offset / 4096 * 4096;
                for b in (first..offset + len as u64).step_by(4096) {
                    if self.bad.lock().unwrap().contains(&(component, b)) {
                        return Err(RemoteError::Checksum { offset: b });
                    }
                }
                let d = &m[&component].1;
                (
                    Response::Data,
                    Bytes::copy_from_slice(&d[offset as usize..offset as usize + len as usize]),
                )
            }
            Request::AllocatedRanges { component } => {
                let n = m.get(&component).map(|e| e.1.len() as u64).unwrap_or(0);
                (Response::Ranges(vec![(0, n)]), Bytes::new())
            }
            other => return Err(RemoteError::BadRequest(format!("{other:?}"))),
        })
    }
}

/// The generation a request carries, if any.
fn generation_of(req: &Request) -> Option<Generation> {
    match req {
        Request::Activate { generation, .. }
        | Request::Write { generation, .. }
        | Request::WriteChecked { generation, .. }
        | Request::WriteZeroes { generation, .. }
        | Request::TrimRanges { generation, .. }
        | Request::Read { generation, .. }
        | Request::Flush { generation, .. }
        | Request::Barrier { generation, .. }
        | Request::Repair { generation, .. }
        | Request::Renew { generation, .. } => Some(*generation),
        _ => None,
    }
}

impl Handler for Mem {
    fn handle(&self, req: Request, payload: Bytes) -> Reply {
        let deaf = self.deaf_to.load(Ordering::SeqCst);
        if deaf != 0 && generation_of(&req) == Some(deaf) {
            return Box::pin(std::future::pending());
        }
        let slow = self.slow_reads_ms.load(Ordering::SeqCst);
        let me = self.me.get().and_then(std::sync::Weak::upgrade);
        // Stripe columns only (components 10 and up): a node orders a
        // read before the writes (trims) sent after it (its `Sequencer`),
        // which this fake does not do for delayed reads.
        let column = matches!(&req, Request::Read { component, .. } if *component >= 10);
        if let (true, true, Some(me)) = (slow > 0, column, me) {
            return Box::pin(async move {
                tokio::time::sleep(Duration::from_millis(slow)).await;
                match me.run(req, payload) {
                    Ok(v) => v,
                    Err(e) => (Response::Err(e), Bytes::new()),
                }
            });
        }
        let r = self.run(req, payload);
        Box::pin(async move {
            match r {
                Ok(v) => v,
                Err(e) => (Response::Err(e), Bytes::new()),
            }
        })
    }
}

/// The directory, as far as the owner sees it.
#[derive(Default)]
struct Dir {
    generation: AtomicU64,
    states: Mutex<Vec<(u64, ComponentState)>>,
    /// Answer nothing but "unavailable": the owner is cut off from it.
    unreachable: AtomicBool,
    /// Growths committed: (size, map log place).
    growths: Mutex<Vec<(u64, Option<u64>)>>,
    /// Answer growth commits "unavailable" (counted), as a directory
    /// without a leader would.
    hold_growths: AtomicBool,
    growths_held: AtomicU64,
}

impl Control for Dir {
    async fn set_component_state(
        &self,
        _v: VolumeId,
        c: u64,
        s: ComponentState,
        g: Generation,
    ) -> Result<(), ControlError> {
        if self.unreachable.load(Ordering::SeqCst) {
            return Err(ControlError::Unavailable("cut off".into()));
        }
        if g != self.generation.load(Ordering::SeqCst) {
            return Err(ControlError::Conflict);
        }
        self.states.lock().unwrap().push((c, s));
        Ok(())
    }

    async fn reclaim(
        &self,
        _v: VolumeId,
        expected: Generation,
    ) -> Result<Generation, ControlError> {
        self.generation
            .compare_exchange(expected, expected + 1, Ordering::SeqCst, Ordering::SeqCst)
            .map(|g| g + 1)
            .map_err(|_| ControlError::Conflict)
    }

    async fn end_reconfig(
        &self,
        _v: VolumeId,
        _g: Generation,
        _end: ChangeEnd,
    ) -> Result<(), ControlError> {
        Err(ControlError::Refused("these tests change no layout".into()))
    }

    async fn commit_growth(
        &self,
        _v: VolumeId,
        g: Generation,
        size: u64,
        map_log_at: Option<u64>,
    ) -> Result<(), ControlError> {
        if g != self.generation.load(Ordering::SeqCst) {
            return Err(ControlError::Conflict);
        }
        if self.hold_growths.load(Ordering::SeqCst) {
            self.growths_held.fetch_add(1, Ordering::SeqCst);
            return Err(ControlError::Unavailable("no leader".into()));
        }
        self.growths.lock().unwrap().push((size, map_log_at));
        Ok(())
    }

    async fn begin_rebuild(
        &self,
        _v: VolumeId,
        _g: Generation,
        _c: Vec<u64>,
    ) -> Result<(), ControlError> {
        Err(ControlError::Refused("these tests rebuild nothing".into()))
    }
}

async fn serve(mem: Arc<Mem>) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    tokio::spawn(shoal_rpc::serve(
        l,
        mem,
        shoal_rpc::PeerAuth::Unauthenticated,
    ));
    addr
}

/// Three nodes' replicas served over RPC, and a directory at generation 1.
async fn setup() -> (Vec<Arc<Mem>>, Vec<String>, Arc<Dir>) {
    let mems: Vec<Arc<Mem>> = (0..3)
        .map(|_| {
            Arc::new(Mem {
                // Started long ago: no lease from before a restart.
                grants: Some(Grants::new(Instant::now() - Duration::from_secs(60))),
                ..Mem::default()
            })
        })
        .collect();
    let mut addrs = Vec::new();
    for m in &mems {
        let _ = m.me.set(Arc::downgrade(m));
        addrs.push(serve(m.clone()).await);
    }
    let dir = Arc::new(Dir::default());
    dir.generation.store(1, Ordering::SeqCst);
    (mems, addrs, dir)
}

fn comp(id: u64, role: ComponentRole, node: u64) -> Component {
    Component {
        id,
        role,
        node,
        device: 1,
        state: ComponentState::Active,
        votes: 1,
    }
}

fn view(addrs: &[String], up: [bool; 3], gen: Generation) -> View {
    let comps = [
        comp(1, ComponentRole::Data, 1),
        comp(2, ComponentRole::Data, 2),
        comp(3, ComponentRole::Witness, 3),
    ];
    View {
        volume: Volume {
            id: 7,
            name: "v".into(),
            size: SIZE,
            policy: Policy::default(),
            components: comps.to_vec(),
            owner: Some(1),
            generation: gen,
            problem: None,
            wrapped_key: None,
            reconfig: None,
            wanted_policy: None,
            grow_to: None,
            map_log_at: None,
            stripe: None,
        },
        repair_delay: shoal_owner::DEFAULT_REPAIR_DELAY,
        resync_bytes_per_s: None,
        previous_owner_gone: false,
        targets: comps
            .iter()
            .zip(addrs)
            .zip(up)
            .map(|((c, a), u)| Target {
                component: c.clone(),
                addr: a.clone(),
                node_up: u,
            })
            .collect(),
    }
}

fn cfg() -> OwnerConfig {
    OwnerConfig {
        node: 1,
        io_timeout: Duration::from_millis(500),
        tick: Duration::from_millis(50),
        io_wait: Duration::from_secs(2),
        peer_auth: shoal_rpc::PeerAuth::Unauthenticated,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_reach_both_copies_and_a_failed_copy_is_marked_before_the_ack() {
    let (mems, addrs, dir) = setup().await;
    let o = Owner::start(cfg(), view(&addrs, [true; 3], 1), 1, dir.clone())
        .await
        .unwrap();
    o.write(4096, Bytes::from(vec![7u8; 8192])).await.unwrap();
    o.write(10, Bytes::from(vec![9u8; 5])).await.unwrap();
    assert_eq!(mems[0].data(1), mems[1].data(2));
    assert_eq!(&o.read(4096, 4).await.unwrap()[..], &[7, 7, 7, 7]);
    assert_eq!(&o.read(8, 4).await.unwrap()[..], &[0, 0, 9, 9]);

    // Copy 2 starts failing: the write still succeeds (copy 1 + witness
    // are a majority), and copy 2 is recorded degraded by the time it does.
    mems[1].broken.store(true, Ordering::SeqCst);
    o.write(0, Bytes::from(vec![1u8; 4096])).await.unwrap();
    assert!(dir
        .states
        .lock()
        .unwrap()
        .contains(&(2, ComponentState::Degraded)));
    assert_eq!(&o.read(0, 2).await.unwrap()[..], &[1, 1]);

    // It comes back: the owner raises the generation, copies, records it active.
    mems[1].broken.store(false, Ordering::SeqCst);
    o.update(view(&addrs, [true; 3], 1));
    let mut healed = false;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        if dir.states.lock().unwrap().last() == Some(&(2, ComponentState::Active)) {
            healed = true;
            break;
        }
    }
    assert!(
        healed,
        "resync did not finish: {:?}",
        dir.states.lock().unwrap()
    );
    assert_eq!(
        dir.generation.load(Ordering::SeqCst),
        2,
        "resync fences with a new generation"
    );
    assert_eq!(
        mems[0].data(1),
        mems[1].data(2),
        "copies identical after resync"
    );
    o.write(0, Bytes::from(vec![3u8; 4096])).await.unwrap();
    assert_eq!(mems[0].data(1), mems[1].data(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_owner_fences_the_old_one() {
    let (mems, addrs, dir) = setup().await;
    let old = Owner::start(cfg(), view(&addrs, [true; 3], 1), 1, dir.clone())
        .await
        .unwrap();
    old.write(0, Bytes::from(vec![5u8; 4096])).await.unwrap();
    dir.generation.store(2, Ordering::SeqCst);
    let new = Owner::start(cfg(), view(&addrs, [true; 3], 2), 2, dir.clone())
        .await
        .unwrap();
    // Deposed by this write's refusal, or already stopped because a
    // witness ping found the newer generation first: either way the old
    // owner takes no write, and its callers go and find the new one.
    let r = old.write(0, Bytes::from(vec![6u8; 4096])).await;
    assert!(
        matches!(r, Err(OwnerError::Deposed | OwnerError::Stopped)),
        "{r:?}"
    );
    for _ in 0..100 {
        if !old.is_running() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!old.is_running(), "the deposed owner stops");
    assert_eq!(&new.read(0, 1).await.unwrap()[..], &[5]);
    new.write(0, Bytes::from(vec![8u8; 4096])).await.unwrap();
    assert_eq!(mems[0].data(1)[0], 8);
    assert_eq!(mems[1].data(2)[0], 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_majority_the_owner_does_not_start() {
    let (_mems, addrs, dir) = setup().await;
    // Only copy 1 reachable: 1 vote of 3.
    let r = Owner::start(cfg(), view(&addrs, [true, false, false], 1), 1, dir).await;
    assert!(matches!(r, Err(OwnerError::Unavailable(_))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_block_is_read_from_the_other_copy_and_repaired_in_place() {
    let (mems, addrs, dir) = setup().await;
    let o = Owner::start(cfg(), view(&addrs, [true; 3], 1), 1, dir.clone())
        .await
        .unwrap();
    let data: Vec<u8> = (0..16 * 4096).map(|i| (i % 253) as u8).collect();
    o.write(0, Bytes::from(data.clone())).await.unwrap();
    assert_eq!(mems[0].crc_mismatches.load(Ordering::SeqCst), 0);
    // Copy 1 (on the owner's node, which reads prefer) rots in block 3.
    mems[0].comps.lock().unwrap().get_mut(&1).unwrap().1[3 * 4096 + 5] ^= 0xff;
    mems[0].bad.lock().unwrap().insert((1, 3 * 4096));
    assert_eq!(&o.read(0, 16 * 4096).await.unwrap()[..], &data[..]);
    let mut repaired = false;
    for _ in 0..100 {
        if mems[0].repairs.load(Ordering::SeqCst) == 1 {
            repaired = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(repaired, "the bad block was not repaired");
    assert_eq!(mems[0].data(1), mems[1].data(2));
    // One bad block does not take the copy out of service.
    assert!(dir.states.lock().unwrap().is_empty());

    // A scrubber's report of a bad block on copy 2: repaired on request;
    // a block rewritten since is left alone.
    mems[1].comps.lock().unwrap().get_mut(&2).unwrap().1[9 * 4096] ^= 1;
    mems[1].bad.lock().unwrap().insert((2, 9 * 4096));
    let r = o
        .execute(shoal_owner::Op::Repair {
            component: 2,
            offset: 9 * 4096 + 17,
        })
        .await
        .unwrap();
    assert_eq!(&r[..], &[1]);
    assert_eq!(mems[0].data(1), mems[1].data(2));
    let r = o
        .execute(shoal_owner::Op::Repair {
            component: 2,
            offset: 9 * 4096,
        })
        .await
        .unwrap();
    assert_eq!(&r[..], &[0], "a good block is not replaced");
    // Bad on both copies: the client gets an I/O error, not old data.
    mems[0].bad.lock().unwrap().insert((1, 5 * 4096));
    mems[1].bad.lock().unwrap().insert((2, 5 * 4096));
    assert!(matches!(
        o.read(5 * 4096, 4096).await,
        Err(OwnerError::Io(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_leave_the_local_copy_once_it_misses_a_write() {
    let (mems, addrs, dir) = setup().await;
    // Copy 1 is on the owner's node: reads go straight to it.
    let o = Owner::start(cfg(), view(&addrs, [true; 3], 1), 1, dir.clone())
        .await
        .unwrap();
    o.write(0, Bytes::from(vec![1u8; 4096])).await.unwrap();
    assert_eq!(&o.read(0, 2).await.unwrap()[..], &[1, 1]);
    // It fails a write, which is acknowledged on copy 2 and the witness.
    mems[0].broken.store(true, Ordering::SeqCst);
    o.write(0, Bytes::from(vec![2u8; 4096])).await.unwrap();
    // It answers again, with the old data: no read may come from it.
    mems[0].broken.store(false, Ordering::SeqCst);
    // (The owner may resync it meanwhile; until then it holds 1s.)
    for _ in 0..50 {
        assert_eq!(&o.read(0, 2).await.unwrap()[..], &[2, 2]);
    }
}

/// The split-brain case: the owner on node 1 is cut off from copy 2 and
/// the witness (they never answer its generation), a newer owner takes
/// over on the other side and writes. The newer owner serves nothing
/// before the old lease must have ended, and from then on the old owner
/// returns no read: never the old data after the new write. Its own write
/// fails within the I/O wait bound instead of hanging.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_owner_stops_reading_before_a_newer_one_serves() {
    let (mems, addrs, dir) = setup().await;
    let old = Owner::start(cfg(), view(&addrs, [true; 3], 1), 1, dir.clone())
        .await
        .unwrap();
    old.write(0, Bytes::from(vec![1u8; 4096])).await.unwrap();
    assert_eq!(&old.read(0, 1).await.unwrap()[..], &[1], "OLD is served");
    // Node 1's host is cut off: copy 2 and the witness never answer it,
    // nor can it reach the directory.
    let cut = Instant::now();
    mems[1].deaf_to.store(1, Ordering::SeqCst);
    mems[2].deaf_to.store(1, Ordering::SeqCst);
    dir.unreachable.store(true, Ordering::SeqCst);

    // The other side claims generation 2 and starts an owner there
    // (copy 1's node is down as far as the directory knows).
    dir.generation.store(2, Ordering::SeqCst);
    let mut cfg2 = cfg();
    cfg2.node = 2;
    let new = Owner::start(cfg2, view(&addrs, [false, true, true], 2), 2, dir.clone());
    let reader = {
        let old = old.clone();
        tokio::spawn(async move {
            // Reads on the cut-off side, as fast as they come.
            let mut answers = Vec::new();
            while cut.elapsed() < Duration::from_millis(u64::from(LEASE_MS) + 1_500) {
                answers.push((old.read(0, 1).await.map(|b| b[0]), Instant::now()));
            }
            answers
        })
    };
    dir.unreachable.store(false, Ordering::SeqCst);
    let new = new.await.unwrap();
    let started = cut.elapsed();
    assert!(
        started >= Duration::from_millis(u64::from(LEASE_MS) - 300),
        "the new owner served after {started:?}, before the old lease could have ended"
    );
    new.write(0, Bytes::from(vec![2u8; 4096])).await.unwrap();
    let acked = Instant::now();
    dir.unreachable.store(true, Ordering::SeqCst);
    let answers = reader.await.unwrap();
    let stale: Vec<_> = answers
        .iter()
        .filter(|(r, at)| *at > acked && matches!(r, Ok(1)))
        .collect();
    assert!(
        stale.is_empty(),
        "OLD read after NEW was acknowledged: {stale:?}"
    );
    assert!(
        answers.iter().any(|(r, _)| r.is_err()),
        "the cut-off owner kept serving reads: {} answers",
        answers.len()
    );

    // A write on the cut-off side fails within the bound (copy 2 times
    // out, the directory cannot record it), it does not hang.
    let t = Instant::now();
    let r = tokio::time::timeout(
        Duration::from_secs(10),
        old.write(0, Bytes::from(vec![3u8; 4096])),
    )
    .await
    .expect("the cut-off write hung");
    assert!(matches!(r, Err(OwnerError::Unavailable(_))), "{r:?}");
    assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
    assert_eq!(mems[1].data(2)[0], 2, "the new side keeps NEW");
}

/// A RAID-5 capacity leg on three in-memory replicas: a stripe is written
/// whole with its parity, every block reads back from its column, and
/// with a column failing or out, rebuilt from the other two (degraded
/// reads); a whole-stripe write needs every column; a newer owner's
/// activation deposes this one; fewer than `k` columns are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stripes_are_written_whole_and_read_back_degraded() {
    use shoal_owner::capacity::{ColumnError, ColumnSet, ColumnTarget};
    use shoal_owner::stripes::{summary_of, UNIT_BYTES};
    let (mems, addrs, _dir) = setup().await;
    let targets: Vec<ColumnTarget> = addrs
        .iter()
        .enumerate()
        .map(|(i, a)| ColumnTarget {
            component: 10 + i as u64,
            device: 1,
            addr: a.clone(),
        })
        .collect();
    let g = shoal_model::StripeGeometry::RAID5_NARROW;
    let auth = shoal_rpc::PeerAuth::Unauthenticated;
    let wait = Duration::from_millis(500);
    let set = ColumnSet::activate(g, (7, 4096), targets.clone(), (1, true), wait, &auth)
        .await
        .unwrap();
    let cols = *set.columns();
    let slot = 1;
    let blocks: Vec<Vec<u8>> = (0..cols.blocks_per_stripe())
        .map(|i| vec![i as u8 ^ 0x5a; 4096])
        .collect();
    let numbers: Vec<u64> = (100..100 + blocks.len() as u64).collect();
    let summary = summary_of(&cols, 7, (1, slot), &numbers);
    let refs: Vec<&[u8]> = blocks.iter().map(Vec::as_slice).collect();
    let units = cols.encode(set.codec(), &summary, &refs).unwrap();
    // A column's share short of a whole unit is refused, nothing sent.
    let mut short = units.clone();
    short[1].truncate(4096);
    assert!(matches!(
        set.write_stripe(slot, short).await,
        Err(ColumnError::Units { .. })
    ));
    set.write_stripe(slot, units.clone()).await.unwrap();
    let at = (slot * UNIT_BYTES) as usize..((slot + 1) * UNIT_BYTES) as usize;
    for (i, m) in mems.iter().enumerate() {
        assert_eq!(
            &m.data(10 + i as u64)[at.clone()],
            &units[i][..],
            "column {i}"
        );
    }
    for (i, b) in blocks.iter().enumerate() {
        let r = set.read_block(slot, i).await.unwrap();
        assert_eq!((&r.data[..], r.failed.len()), (&b[..], 0), "block {i}");
    }
    // A bad block on a data column and one on the parity column: read
    // around (the columns stay in service), then repaired from the
    // others' rows, as a scrubber asks.
    let (pos, off) = cols.block_at(slot, 5);
    let parity = cols.position_of(slot, shoal_owner::stripes::Unit::Parity(0));
    let parity_off = slot * UNIT_BYTES + 3 * 4096;
    for (p, o) in [(pos, off), (parity, parity_off)] {
        mems[p].bad.lock().unwrap().insert((10 + p as u64, o));
    }
    let r = set.read_block(slot, 5).await.unwrap();
    assert_eq!((&r.data[..], r.failed.len()), (&blocks[5][..], 0));
    for (p, o) in [(pos, off), (parity, parity_off)] {
        assert!(set.repair_block(p, o).await.unwrap(), "column {p}");
        assert!(!set.repair_block(p, o).await.unwrap(), "repaired twice");
        let at = o as usize..o as usize + 4096;
        let unit_at =
            at.start - (slot * UNIT_BYTES) as usize..at.end - (slot * UNIT_BYTES) as usize;
        assert_eq!(&mems[p].data(10 + p as u64)[at], &units[p][unit_at]);
    }
    assert_eq!(mems[pos].repairs.load(Ordering::SeqCst), 1);
    assert_eq!(set.in_service().len(), 3);
    // Blocks of several units at once, in any order: one request per
    // column for a slot's blocks on it; a span with a bad block in it is
    // read block by block, the bad one rebuilt.
    let reads =
        |mems: &[Arc<Mem>]| -> u64 { mems.iter().map(|m| m.reads.load(Ordering::SeqCst)).sum() };
    let asked = [
        (slot, 40),
        (slot, 3),
        (slot, 5),
        (slot, 33),
        (slot, 61),
        (slot, 0),
    ];
    let want: Vec<&[u8]> = asked.iter().map(|&(_, i)| &blocks[i][..]).collect();
    let before = reads(&mems);
    let got = set.read_blocks(&asked, 31).await.data.unwrap();
    assert_eq!(got.iter().map(|b| &b[..]).collect::<Vec<_>>(), want);
    assert_eq!(reads(&mems) - before, 2, "one request per column");
    // Only neighbours with no gap allowed: 0, 1 and 2 are one run, 5
    // another (two blocks between), 33 a third, on the other column.
    let before = reads(&mems);
    let near = [(slot, 0), (slot, 1), (slot, 2), (slot, 5), (slot, 33)];
    let got = set.read_blocks(&near, 0).await;
    assert_eq!(
        got.data
            .as_ref()
            .unwrap()
            .iter()
            .map(|b| &b[..])
            .collect::<Vec<_>>(),
        near.iter()
            .map(|&(_, i)| &blocks[i][..])
            .collect::<Vec<_>>()
    );
    assert_eq!(
        (reads(&mems) - before, got.failed.len()),
        (3, 0),
        "runs of neighbours"
    );
    mems[pos].bad.lock().unwrap().insert((10 + pos as u64, off));
    let got = set.read_blocks(&asked, 31).await.data.unwrap();
    assert_eq!(got.iter().map(|b| &b[..]).collect::<Vec<_>>(), want);
    assert!(set.repair_block(pos, off).await.unwrap());
    // The column of block 0 fails: its blocks are rebuilt from the
    // other two.
    let lost = cols.block_at(slot, 0).0;
    mems[lost].broken.store(true, Ordering::SeqCst);
    let on_lost: Vec<usize> = (0..blocks.len())
        .filter(|&i| cols.block_at(slot, i).0 == lost)
        .collect();
    assert_eq!(on_lost.len(), 31);
    let asked: Vec<(u64, usize)> = on_lost.iter().map(|&i| (slot, i)).collect();
    let before = reads(&mems);
    let got = set.read_blocks(&asked, 0).await;
    assert_eq!(got.failed, vec![lost]);
    // The failed column asked once for its run, then the run rebuilt
    // from the two others: two requests per block, not three.
    assert_eq!(reads(&mems) - before, 1 + 2 * 31);
    for (&i, b) in on_lost.iter().zip(got.data.as_ref().unwrap()) {
        assert_eq!(&b[..], &blocks[i][..], "block {i} rebuilt in a span");
    }
    // A rebuild that cannot be done (the parity's row is bad too): the
    // read fails, and still reports the failed column.
    let parity = cols.position_of(slot, shoal_owner::stripes::Unit::Parity(0));
    let row = cols.block_at(slot, 0).1;
    mems[parity]
        .bad
        .lock()
        .unwrap()
        .insert((10 + parity as u64, row));
    let got = set.read_blocks(&[(slot, 0), (slot, 1)], 0).await;
    assert!(got.data.is_err(), "{:?}", got.data.map(|d| d.len()));
    assert_eq!(got.failed, vec![lost]);
    mems[parity].bad.lock().unwrap().clear();
    for &i in &on_lost {
        let r = set.read_block(slot, i).await.unwrap();
        assert_eq!(
            (&r.data[..], r.failed.clone()),
            (&blocks[i][..], vec![lost])
        );
    }
    set.set_out(lost);
    assert_eq!(set.in_service().len(), 2);
    let r = set.read_block(slot, 0).await.unwrap();
    assert_eq!((&r.data[..], r.failed.len()), (&blocks[0][..], 0));
    assert_eq!(
        set.write_stripe(slot, units).await,
        Err(ColumnError::TooFewColumns { have: 2, need: 3 })
    );
    // Two columns failing: 2+1 cannot take over.
    let other = (lost + 1) % 3;
    mems[other].broken.store(true, Ordering::SeqCst);
    let e = ColumnSet::activate(g, (7, 4096), targets.clone(), (2, true), wait, &auth)
        .await
        .err();
    assert_eq!(e, Some(ColumnError::TooFewColumns { have: 1, need: 2 }));
    // A newer owner: the old set is deposed on its next read.
    mems[lost].broken.store(false, Ordering::SeqCst);
    mems[other].broken.store(false, Ordering::SeqCst);
    ColumnSet::activate(g, (7, 4096), targets.clone(), (3, true), wait, &auth)
        .await
        .unwrap();
    let e = set.read_block(slot, 0).await.err();
    assert!(matches!(e, Some(ColumnError::Deposed { .. })), "{e:?}");
    // A node that lost a column once stripes exist: an owner that does
    // not create columns leaves it out of service (degraded reads, then a
    // rebuild) instead of bringing it back empty.
    mems[lost].comps.lock().unwrap().remove(&(10 + lost as u64));
    let set = ColumnSet::activate(g, (7, 4096), targets, (4, false), wait, &auth)
        .await
        .unwrap();
    assert_eq!(set.in_service().len(), 2);
    assert!(!set.in_service().contains(&lost));
    assert!(!mems[lost]
        .comps
        .lock()
        .unwrap()
        .contains_key(&(10 + lost as u64)));
    for (i, b) in blocks.iter().enumerate() {
        let r = set.read_block(slot, i).await.unwrap();
        assert_eq!(&r.data[..], &b[..], "block {i} read around the lost column");
    }
}

/// A RAID-5 volume on the three in-memory nodes: copies 1 and 2 and
/// witness 3 (the performance leg), stripe columns 10, 11, 12.
fn ec_view(addrs: &[String], gen: Generation) -> View {
    ec_view_of(addrs, gen, SIZE)
}

/// [`ec_view`] of a volume of `size` bytes.
fn ec_view_of(addrs: &[String], gen: Generation, size: u64) -> View {
    let mut comps = vec![
        comp(1, ComponentRole::Data, 1),
        comp(2, ComponentRole::Data, 2),
        comp(3, ComponentRole::Witness, 3),
    ];
    for p in 0..3u8 {
        let mut c = comp(
            10 + u64::from(p),
            ComponentRole::Stripe { position: p },
            1 + u64::from(p),
        );
        c.votes = 0;
        comps.push(c);
    }
    let mut v = view(addrs, [true; 3], gen);
    v.volume.size = size;
    v.volume.policy.layout = shoal_model::Layout::Raid5;
    v.volume.stripe = Some(shoal_model::StripeGeometry::RAID5_NARROW);
    v.volume.components = comps.clone();
    v.targets = comps
        .into_iter()
        .map(|c| Target {
            addr: addrs[c.node as usize - 1].clone(),
            component: c,
            node_up: true,
        })
        .collect();
    v
}

/// The first 4 KiB block where `got` and `want` differ, with a few of its
/// bytes each (None: equal): a failure names the block, not megabytes.
fn first_difference(got: &[u8], want: &[u8]) -> Option<(usize, Vec<u8>, Vec<u8>)> {
    if got.len() != want.len() {
        return Some((
            usize::MAX,
            got.len().to_le_bytes().into(),
            want.len().to_le_bytes().into(),
        ));
    }
    let i = got
        .chunks(4096)
        .zip(want.chunks(4096))
        .position(|(a, b)| a != b)?;
    let at = |d: &[u8]| d[i * 4096..].iter().take(16).copied().collect();
    Some((i, at(got), at(want)))
}

/// Waits (bounded) until `f` holds.
async fn eventually(what: &str, f: impl Fn() -> bool) {
    for _ in 0..500 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{what}: not within 10 s");
}

/// The erasure-coded owner end to end over RPC: writes are staged on the
/// performance leg and destaged into stripes (the leg's copies trimmed,
/// the columns holding data and parity), reads come back from wherever
/// each block is, a zeroing over destaged blocks reads as zeros, a new
/// owner recovers the map from the log and reads the same, and with a
/// node failing, blocks of its column are rebuilt from the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_erasure_coded_volume_destages_and_reads_back_through_owners_and_a_failure() {
    use shoal_owner::capacity::TieredOwner;
    let (mems, addrs, dir) = setup().await;
    let o = TieredOwner::start(cfg(), ec_view(&addrs, 1), 1, dir.clone())
        .await
        .unwrap();
    const N: usize = 200;
    let block = |i: usize, round: u8| vec![(i as u8).wrapping_mul(7) ^ round | 1; 4096];
    let mut want: Vec<Vec<u8>> = (0..N).map(|i| block(i, 1)).collect();
    let all: Vec<u8> = want.concat();
    let w = Op::Write {
        offset: 0,
        data: Bytes::from(all),
    };
    o.execute(w).await.unwrap();
    // Destaged: the performance leg's copies no longer hold the blocks.
    eventually("destaged", || {
        mems[0].data(1)[..N * 4096].iter().all(|&b| b == 0)
            && mems[1].data(2)[..N * 4096].iter().all(|&b| b == 0)
    })
    .await;
    assert!(mems
        .iter()
        .enumerate()
        .all(|(i, m)| m.data(10 + i as u64).iter().any(|&b| b != 0)));
    let read_all = |o: TieredOwner| read_blocks(o, N);
    assert_eq!(
        first_difference(&read_all(o.clone()).await, &want.concat()),
        None
    );
    // Overwrites (staged again) and a zeroing across destaged blocks.
    for i in [3, 64, 65, 199] {
        want[i] = block(i, 2);
        let w = Op::Write {
            offset: (i * 4096) as u64,
            data: Bytes::from(want[i].clone()),
        };
        o.execute(w).await.unwrap();
    }
    o.execute(Op::Zero {
        offset: 10 * 4096,
        len: 20 * 4096,
    })
    .await
    .unwrap();
    for w in &mut want[10..30] {
        w.fill(0);
    }
    assert_eq!(
        first_difference(&read_all(o.clone()).await, &want.concat()),
        None
    );
    // Writes and zeroings not of whole blocks: read-modify-writes over
    // destaged blocks, and reads not of whole blocks.
    let w = Op::Write {
        offset: 5 * 4096 + 512,
        data: Bytes::from(vec![0xee; 1024]),
    };
    o.execute(w).await.unwrap();
    want[5][512..1536].fill(0xee);
    let w = Op::Write {
        offset: 40 * 4096 + 4000,
        data: Bytes::from(vec![0xdd; 200]),
    };
    o.execute(w).await.unwrap();
    want[40][4000..].fill(0xdd);
    want[41][..104].fill(0xdd);
    o.execute(Op::Zero {
        offset: 50 * 4096 + 100,
        len: 3 * 4096,
    })
    .await
    .unwrap();
    want[50][100..].fill(0);
    want[51].fill(0);
    want[52].fill(0);
    want[53][..100].fill(0);
    // Eight sectors of one block written at once: none is lost to
    // another's read-modify-write.
    let sectors = (0..8u8).map(|k| {
        let o = o.clone();
        let w = Op::Write {
            offset: 70 * 4096 + u64::from(k) * 512,
            data: Bytes::from(vec![0x80 | k; 512]),
        };
        tokio::spawn(async move { o.execute(w).await })
    });
    for h in sectors.collect::<Vec<_>>() {
        h.await.unwrap().unwrap();
    }
    for k in 0..8usize {
        want[70][k * 512..(k + 1) * 512].fill(0x80 | k as u8);
    }
    // A whole-block write and a sector of the same block at once: one
    // after the other, whichever first, never the sector over the
    // block's older data.
    let (a, b) = (o.clone(), o.clone());
    let whole = tokio::spawn(async move {
        let w = Op::Write {
            offset: 80 * 4096,
            data: Bytes::from(vec![0x11; 4096]),
        };
        a.execute(w).await
    });
    let sector = tokio::spawn(async move {
        let w = Op::Write {
            offset: 80 * 4096,
            data: Bytes::from(vec![0x22; 512]),
        };
        b.execute(w).await
    });
    whole.await.unwrap().unwrap();
    sector.await.unwrap().unwrap();
    let got = o
        .execute(Op::Read {
            offset: 80 * 4096,
            len: 4096,
        })
        .await
        .unwrap();
    let mut sector_last = vec![0x11; 4096];
    sector_last[..512].fill(0x22);
    assert!(
        got[..] == [0x11; 4096][..] || got[..] == sector_last[..],
        "{:?}",
        &got[..16]
    );
    want[80] = got.to_vec();
    let flat = want.concat();
    let r = o
        .execute(Op::Read {
            offset: 40 * 4096 + 3000,
            len: 2000,
        })
        .await
        .unwrap();
    assert_eq!(&r[..], &flat[40 * 4096 + 3000..40 * 4096 + 5000]);
    assert_eq!(first_difference(&read_all(o.clone()).await, &flat), None);
    // A scrubber's bad block on a column, through the owner: rebuilt
    // from the other columns (slot 0's first data row of column 11).
    mems[1].bad.lock().unwrap().insert((11, 4096));
    let r = o
        .execute(Op::Repair {
            component: 11,
            offset: 4096,
        })
        .await
        .unwrap();
    assert_eq!(&r[..], &[1]);
    assert!(mems[1].bad.lock().unwrap().is_empty());
    // A new owner: the map from the log, the pending blocks from the leg.
    o.stop();
    dir.generation.store(2, Ordering::SeqCst);
    let o = TieredOwner::start(cfg(), ec_view(&addrs, 2), 2, dir.clone())
        .await
        .unwrap();
    assert_eq!(
        first_difference(&read_all(o.clone()).await, &want.concat()),
        None
    );
    // Node 3 fails (the witness and column 12): its blocks are rebuilt.
    mems[2].broken.store(true, Ordering::SeqCst);
    assert_eq!(
        first_difference(&read_all(o.clone()).await, &want.concat()),
        None
    );
}

/// The first `n` blocks of a volume, read in one request through `o`.
async fn read_blocks(o: shoal_owner::capacity::TieredOwner, n: usize) -> Bytes {
    o.execute(Op::Read {
        offset: 0,
        len: (n * 4096) as u32,
    })
    .await
    .unwrap()
}

/// Owners of an erasure-coded volume stopped at any moment under a
/// stream of writes (destages, records and trims in flight), each
/// followed by a new one: every acknowledged write reads back, and a
/// block whose last write was not acknowledged reads as that write or
/// the one acknowledged before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn erasure_coded_owners_stopped_mid_destage_lose_no_acknowledged_write() {
    use std::collections::HashMap;
    let (_mems, addrs, dir) = setup().await;
    const BLOCKS: u64 = 300;
    // Per block: the last acknowledged value, and one sent after it and
    // not acknowledged (if any).
    let mut acked: HashMap<u64, u8> = HashMap::new();
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut gen = 0u64;
    let owner = |gen: u64| {
        dir.generation.store(gen, Ordering::SeqCst);
        Owner::start(cfg(), ec_view(&addrs, gen), gen, dir.clone())
    };
    for round in 1..=4u8 {
        gen += 1;
        let o = owner(gen).await.unwrap();
        // What the last owner left: acknowledged values, or an
        // unacknowledged write's.
        for b in 0..BLOCKS {
            let got = o.read(b * 4096, 4096).await.unwrap();
            let want = acked.get(&b).copied().unwrap_or(0);
            assert!(got.iter().all(|&x| x == got[0]), "block {b} torn");
            assert_eq!(got[0], want, "block {b} after round {}", round - 1);
        }
        // Writes in flight, 8 at a time, for a while, then the owner stops.
        let mut inflight = Vec::new();
        for i in 0..(200 + next() % 400) {
            let b = next() % BLOCKS;
            let v = round << 5 | (i % 31) as u8 | 1;
            // Mostly single blocks; some of three; some of a whole 2+1
            // stripe, or a stripe and more, which go straight to the
            // columns.
            let len = match next() % 16 {
                0..=3 => 3,
                4 => 62,
                5 => 70,
                _ => 1,
            };
            let len = len.min(BLOCKS - b);
            // Writes in flight together touch distinct blocks: which of
            // two overlapping ones lands last is anyone's.
            let overlaps = |&(f, n, _, _): &(u64, u64, u8, _)| b < f + n && f < b + len;
            if inflight.iter().any(overlaps) {
                continue;
            }
            let o2 = o.clone();
            inflight.push((
                b,
                len,
                v,
                tokio::spawn(async move {
                    o2.write(b * 4096, Bytes::from(vec![v; (len * 4096) as usize]))
                        .await
                }),
            ));
            if inflight.len() == 8 {
                let (b, len, v, h) = inflight.remove(0);
                if h.await.unwrap().is_ok() {
                    for x in b..b + len {
                        acked.insert(x, v);
                    }
                }
            }
        }
        o.stop();
        // Writes still in flight may or may not have landed: the next
        // owner reads what is there, and that is what counts from then.
        let mut unsure = Vec::new();
        for (b, len, v, h) in inflight {
            match h.await.unwrap() {
                Ok(()) => (b..b + len).for_each(|x| {
                    acked.insert(x, v);
                }),
                Err(_) => unsure.push((b, len, v)),
            }
        }
        if !unsure.is_empty() {
            gen += 1;
            let peek = owner(gen).await.unwrap();
            for (b, len, v) in unsure {
                for x in b..b + len {
                    let got = peek.read(x * 4096, 4096).await.unwrap()[0];
                    let before = acked.get(&x).copied().unwrap_or(0);
                    assert!(
                        got == v || got == before,
                        "block {x}: {got}, not {v} or {before}"
                    );
                    acked.insert(x, got);
                }
            }
            peek.stop();
        }
    }
}

/// Writes of whole stripes go straight to the columns: the performance
/// leg's copies get none of their data (only map records past the
/// volume's end), the rest of a write is staged, and everything reads
/// back, also through a new owner. With a column's node failing, such a
/// write is staged instead and still acknowledged, and reads back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_stripe_writes_go_straight_to_the_columns() {
    use shoal_owner::capacity::TieredOwner;
    let (mems, addrs, dir) = setup().await;
    let size = ec_view(&addrs, 1).volume.size;
    let o = TieredOwner::start(cfg(), ec_view(&addrs, 1), 1, dir.clone())
        .await
        .unwrap();
    // Four 2+1 stripes of 62 blocks, then 10 blocks more: 258 blocks.
    const N: usize = 4 * 62 + 10;
    let data: Vec<u8> = (0..N * 4096).map(|i| (i / 4096 % 251) as u8 | 1).collect();
    let writes = (0..4).map(|k| {
        let o = o.clone();
        let part = Bytes::from(data[k * 62 * 4096..(k + 1) * 62 * 4096].to_vec());
        tokio::spawn(async move {
            let w = Op::Write {
                offset: (k * 62 * 4096) as u64,
                data: part,
            };
            o.execute(w).await
        })
    });
    for h in writes.collect::<Vec<_>>() {
        h.await.unwrap().unwrap();
    }
    let tail = Op::Write {
        offset: (4 * 62 * 4096) as u64,
        data: Bytes::from(data[4 * 62 * 4096..].to_vec()),
    };
    o.execute(tail).await.unwrap();
    // The leg's copies: the ten staged blocks only.
    let leg = mems[0].written_below(1, size) + mems[1].written_below(2, size);
    assert_eq!(leg, 2 * 10 * 4096, "bytes of client data on the leg");
    let read_all = |o: TieredOwner| read_blocks(o, N);
    assert_eq!(first_difference(&read_all(o.clone()).await, &data), None);
    o.stop();
    dir.generation.store(2, Ordering::SeqCst);
    let o = TieredOwner::start(cfg(), ec_view(&addrs, 2), 2, dir.clone())
        .await
        .unwrap();
    assert_eq!(first_difference(&read_all(o.clone()).await, &data), None);
    // Three stripes in one write: those in consecutive free slots go as
    // one write to each column (the cleaner and the destage of the staged
    // blocks may have taken slots in between).
    let mut data = data;
    for b in &mut data[..3 * 62 * 4096] {
        *b = b.rotate_left(1);
    }
    let w = Op::Write {
        offset: 0,
        data: Bytes::from(data[..3 * 62 * 4096].to_vec()),
    };
    o.execute(w).await.unwrap();
    for (m, c) in mems.iter().zip(10..) {
        let writes = m.writes.lock().unwrap().clone();
        let merged = writes.iter().any(|w| w.0 == c && w.2 >= 2 * (128 << 10));
        assert!(merged, "column {c}: {writes:?}");
    }
    assert_eq!(first_difference(&read_all(o.clone()).await, &data), None);
    // A column's node fails: whole stripes are staged, and acknowledged.
    mems[2].broken.store(true, Ordering::SeqCst);
    let again: Vec<u8> = data.iter().map(|&b| b ^ 0x80).collect();
    let w = Op::Write {
        offset: 0,
        data: Bytes::from(again[..2 * 62 * 4096].to_vec()),
    };
    o.execute(w).await.unwrap();
    let mut want = data.clone();
    want[..2 * 62 * 4096].copy_from_slice(&again[..2 * 62 * 4096]);
    assert_eq!(first_difference(&read_all(o.clone()).await, &want), None);
    let staged = mems[0].written_below(1, size);
    assert!(staged >= (10 + 2 * 62) * 4096, "{staged} bytes staged");
}

/// A 64-block volume, whose columns have 20 stripe slots, written whole
/// and then one block at a time round after round, each round
/// destaged while idle into a stripe of its own: only the cleaner, moving
/// the live blocks of the emptiest slots together, keeps slots free, and
/// every round still leaves the performance leg empty and every block
/// readable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cleaner_keeps_an_overwritten_erasure_coded_volume_destaging() {
    const N: u64 = 64;
    let (mems, o) = ec_owner(N).await;
    let want: Vec<std::sync::atomic::AtomicU8> = (0..N).map(|_| Default::default()).collect();
    for round in 1..=30u8 {
        cleaner_round(&o, &mems[0], round, N, &want).await;
        let want: Vec<u8> = want.iter().map(|w| w.load(Ordering::SeqCst)).collect();
        for b in 0..N {
            let got = o.read(b * 4096, 4096).await.unwrap();
            assert!(
                got.iter().all(|&x| x == want[b as usize]),
                "round {round} block {b}: {}",
                got[0]
            );
        }
    }
}

/// A read of 64 destaged blocks (a stripe written straight to the
/// columns and two blocks destaged after it) asks each column once per
/// run of neighbours in a unit: three requests, not 64.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_of_destaged_neighbours_is_one_request_per_run() {
    const N: u64 = 64;
    let (mems, o) = ec_owner(N).await;
    let data: Vec<u8> = (0..N * 4096).map(|i| (i / 4096) as u8 ^ 0x33).collect();
    o.write(0, Bytes::from(data.clone())).await.unwrap();
    eventually("the write destaged", || {
        mems[0].data(1)[..(N * 4096) as usize]
            .iter()
            .all(|&x| x == 0)
    })
    .await;
    let reads = || -> u64 { mems.iter().map(|m| m.reads.load(Ordering::SeqCst)).sum() };
    let before = reads();
    let got = o.read(0, (N * 4096) as u32).await.unwrap();
    assert_eq!(first_difference(&got, &data), None);
    assert_eq!(reads() - before, 3, "one request per run of neighbours");
}

/// An erasure-coded owner of an `n`-block volume on three in-memory
/// replicas, started: the replicas and the owner.
async fn ec_owner(n: u64) -> (Vec<Arc<Mem>>, Owner) {
    let (mems, addrs, dir) = setup().await;
    let o = Owner::start(cfg(), ec_view_of(&addrs, 1, n * 4096), 1, dir.clone())
        .await
        .unwrap();
    (mems, o)
}

/// One round of the cleaner tests on an `n`-block volume: all blocks in
/// round 1, then one other block each round (so that every round's
/// stripe stays live and the slots run out without the cleaner), each
/// write's round stored in `acked` once acknowledged; then waits until the
/// round is destaged (the performance leg's copy on `leg` is empty).
async fn cleaner_round(
    o: &Owner,
    leg: &Mem,
    round: u8,
    n: u64,
    acked: &[std::sync::atomic::AtomicU8],
) {
    let hit = |b: u64| round == 1 || b == u64::from(round) * 5 % n;
    for b in (0..n).filter(|&b| hit(b)) {
        o.write(b * 4096, Bytes::from(vec![round; 4096]))
            .await
            .unwrap();
        acked[b as usize].store(round, Ordering::SeqCst);
    }
    eventually("the round destaged", || {
        leg.data(1)[..(n * 4096) as usize].iter().all(|&x| x == 0)
    })
    .await;
}

/// Reads of destaged blocks go to the columns from the caller, without
/// the loop, while the loop destages and the cleaner moves blocks and
/// writes new stripes into the slots it frees: two readers going round the
/// volume all the while only ever see whole blocks, never older than the
/// last acknowledged write of the block when the read began.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_without_the_loop_race_destage_and_cleaner_safely() {
    use std::sync::atomic::{AtomicBool, AtomicU8};
    const N: u64 = 64;
    let (mems, o) = ec_owner(N).await;
    // Reads take 3 ms at the columns: a stripe written into the slot of
    // a read in flight would be read.
    for m in &mems {
        m.slow_reads_ms.store(3, Ordering::SeqCst);
    }
    let acked: Arc<Vec<AtomicU8>> = Arc::new((0..N).map(|_| AtomicU8::new(0)).collect());
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..2u64)
        .map(|r| {
            let (o, acked, stop) = (o.clone(), acked.clone(), stop.clone());
            tokio::spawn(async move {
                let mut reads = 0u64;
                let mut b = r * 31;
                while !stop.load(Ordering::SeqCst) {
                    b = (b + 7) % N;
                    let lo = acked[b as usize].load(Ordering::SeqCst);
                    let got = o.read(b * 4096, 4096).await.unwrap();
                    assert!(got.iter().all(|&x| x == got[0]), "block {b} torn");
                    assert!(
                        got[0] >= lo,
                        "block {b}: {} after {lo} was acknowledged",
                        got[0]
                    );
                    reads += 1;
                }
                reads
            })
        })
        .collect();
    for round in 1..=12u8 {
        cleaner_round(&o, &mems[0], round, N, &acked).await;
    }
    stop.store(true, Ordering::SeqCst);
    for r in readers {
        let reads = r.await.unwrap();
        assert!(reads > 100, "{reads} reads");
    }
    for b in 0..N {
        let got = o.read(b * 4096, 4096).await.unwrap();
        assert_eq!(
            got[0],
            acked[b as usize].load(Ordering::SeqCst),
            "block {b}"
        );
    }
}

/// An erasure-coded volume grows: its owner grows the columns and the
/// leg, moves the map log past the new end (a checkpoint there), trims
/// the old log and commits; meanwhile the old end holds. An owner stopped
/// with the commit unanswered leaves it to the next one, which finds the
/// log moved, trims the old one again and commits; data written before
/// and after reads back through a third owner of the grown volume.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_erasure_coded_volume_grows_through_a_new_owner() {
    let (mems, addrs, dir) = setup().await;
    dir.generation.store(1, Ordering::SeqCst);
    let o = Owner::start(cfg(), ec_view(&addrs, 1), 1, dir.clone())
        .await
        .unwrap();
    const N: usize = 200;
    let old: Vec<u8> = (0..N * 4096).map(|i| (i / 4096) as u8 | 1).collect();
    let w = Op::Write {
        offset: 0,
        data: Bytes::from(old.clone()),
    };
    o.execute(w).await.unwrap();
    eventually("destaged", || {
        mems[0].data(1)[..N * 4096].iter().all(|&b| b == 0)
    })
    .await;
    // The growth, its commit held: the log moves, the old one is trimmed.
    dir.hold_growths.store(true, Ordering::SeqCst);
    let mut v = ec_view(&addrs, 1);
    v.volume.grow_to = Some(2 * SIZE);
    o.update(v.clone());
    eventually("the commit proposed", || {
        dir.growths_held.load(Ordering::SeqCst) > 0
    })
    .await;
    let log = shoal_owner::map_log_bytes(SIZE) as usize;
    let s = SIZE as usize;
    for (m, c) in [(0, 1), (1, 2)] {
        let d = mems[m].data(c);
        assert!(d.len() >= 2 * s + log, "copy {c} grown to {}", d.len());
        assert!(
            d[s..s + log].iter().all(|&b| b == 0),
            "old log trimmed on {c}"
        );
        assert!(
            d[2 * s..].iter().any(|&b| b != 0),
            "a checkpoint at the new end on {c}"
        );
    }
    let past = Op::Write {
        offset: SIZE,
        data: Bytes::from(vec![7; 4096]),
    };
    let e = o.execute(past.clone()).await.unwrap_err();
    assert!(matches!(e, OwnerError::OutOfRange), "{e:?}");
    // A new owner finds the log moved and commits.
    o.stop();
    eventually("stopped", || !o.is_running()).await;
    // (The directory fences the stopped owner's commit, still retried.)
    dir.generation.store(2, Ordering::SeqCst);
    dir.hold_growths.store(false, Ordering::SeqCst);
    let mut v2 = ec_view(&addrs, 2);
    v2.volume.grow_to = Some(2 * SIZE);
    let o2 = Owner::start(cfg(), v2, 2, dir.clone()).await.unwrap();
    eventually("the growth committed", || {
        dir.growths.lock().unwrap().as_slice() == [(2 * SIZE, None)]
    })
    .await;
    // The new end is served (once the commit's answer is in).
    let new: Vec<u8> = (0..N * 4096).map(|i| (i / 4096) as u8 | 0x80).collect();
    let mut wrote = Err(OwnerError::OutOfRange);
    for _ in 0..100 {
        let w = Op::Write {
            offset: SIZE,
            data: Bytes::from(new.clone()),
        };
        wrote = o2.execute(w).await;
        if wrote.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    wrote.unwrap();
    let read = |o: Owner, offset: u64| async move {
        o.execute(Op::Read {
            offset,
            len: (N * 4096) as u32,
        })
        .await
        .unwrap()
    };
    assert_eq!(first_difference(&read(o2.clone(), 0).await, &old), None);
    assert_eq!(first_difference(&read(o2.clone(), SIZE).await, &new), None);
    // Destaged into the columns' new slots too, then a third owner of
    // the grown volume reads both from the map at its new end.
    eventually("destaged past the old end", || {
        mems[0].data(1)[s..s + N * 4096].iter().all(|&b| b == 0)
    })
    .await;
    o2.stop();
    eventually("stopped", || !o2.is_running()).await;
    dir.generation.store(3, Ordering::SeqCst);
    let o3 = Owner::start(cfg(), ec_view_of(&addrs, 3, 2 * SIZE), 3, dir.clone())
        .await
        .unwrap();
    assert_eq!(first_difference(&read(o3.clone(), 0).await, &old), None);
    assert_eq!(first_difference(&read(o3.clone(), SIZE).await, &new), None);
    o3.stop();
}
