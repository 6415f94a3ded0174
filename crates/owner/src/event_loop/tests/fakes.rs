//! The loop's world, faked without sockets: replicas served in this
//! process through `shoal_rpc`'s local links (a `Peer` to an address
//! registered with [`shoal_rpc::register_local`] calls its handler
//! directly), answering from a script and logging what they were asked in
//! the order they were asked; a directory that records what the loop
//! proposes; and a rig that builds a [`Loop`] over them and feeds it
//! events one at a time.

use super::super::replica::{Layouts, Mode, Replica};
use super::super::{Flow, Internal, Loop};
use crate::{
    ChangeEnd, Control, ControlError, Event, Op, OwnerConfig, OwnerError, ReadRoute, REGION,
};
use bytes::Bytes;
use futures::StreamExt;
use shoal_model::{ComponentRole, ComponentState, Generation, VolumeId};
use shoal_rpc::{Handler, Peer, RegionSet, RemoteError, Request, Response};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// Size of the test volume, in bytes.
pub(super) const SIZE: u64 = 4 * REGION;
/// The loop's I/O timeout in tests, in milliseconds: short, so that a
/// replica that hangs fails fast.
const IO_TIMEOUT_MS: u64 = 100;
/// Longest a test waits for the loop's next event, in milliseconds.
const EVENT_WAIT_MS: u64 = 5_000;
/// Most events a test applies while waiting for a state.
const MAX_STEPS: usize = 1_000;
/// How long a test lets the loop's spawned tasks run, in milliseconds:
/// far less than [`IO_TIMEOUT_MS`], so no request times out meanwhile.
const SETTLE_MS: u64 = 20;

/// How a fake replica answers a request.
#[derive(Clone, Debug, Default)]
pub(super) enum Answer {
    #[default]
    Ok,
    Err(RemoteError),
    /// Never: the loop's timeout fires.
    Hang,
}

/// A replica in memory: reads answer `fill` bytes; everything else
/// succeeds, unless scripted otherwise (reads, activations and the rest
/// separately).
#[derive(Default)]
pub(super) struct FakeReplica {
    log: Mutex<Vec<Request>>,
    reads: Mutex<Answer>,
    activations: Mutex<Answer>,
    others: Mutex<Answer>,
    fill: u8,
    ranges: Mutex<Vec<(u64, u64)>>,
    /// What `TrackedRegions` answers; `None`: `All`.
    tracked: Mutex<Option<RegionSet>>,
}

impl FakeReplica {
    pub(super) fn answer_reads(&self, a: Answer) {
        *self.reads.lock().unwrap() = a;
    }

    pub(super) fn answer_activations(&self, a: Answer) {
        *self.activations.lock().unwrap() = a;
    }

    /// How every request but reads and activations is answered.
    pub(super) fn answer_others(&self, a: Answer) {
        *self.others.lock().unwrap() = a;
    }

    /// What `AllocatedRanges` answers.
    pub(super) fn allocate(&self, ranges: &[(u64, u64)]) {
        *self.ranges.lock().unwrap() = ranges.to_vec();
    }

    /// What `TrackedRegions` answers (`All` until this is called).
    pub(super) fn track(&self, set: RegionSet) {
        *self.tracked.lock().unwrap() = Some(set);
    }

    /// The requests received so far, in order.
    pub(super) fn requests(&self) -> Vec<Request> {
        self.log.lock().unwrap().clone()
    }

    fn ok(&self, req: &Request) -> (Response, Bytes) {
        match req {
            Request::Read { len, .. } => {
                (Response::Data, Bytes::from(vec![self.fill; *len as usize]))
            }
            Request::Activate { .. } => (
                Response::Activated {
                    dirty: vec![],
                    lease_ms: 0,
                },
                Bytes::new(),
            ),
            Request::AllocatedRanges { .. } => (
                Response::Ranges(self.ranges.lock().unwrap().clone()),
                Bytes::new(),
            ),
            Request::Repair { .. } => (Response::Repaired(true), Bytes::new()),
            Request::TrackedRegions { .. } => {
                let set = self.tracked.lock().unwrap().clone();
                (
                    Response::Tracked(set.unwrap_or(RegionSet::All)),
                    Bytes::new(),
                )
            }
            _ => (Response::Ok, Bytes::new()),
        }
    }
}

impl Handler for FakeReplica {
    fn handle(&self, req: Request, _payload: Bytes) -> shoal_rpc::Reply {
        let answer = match req {
            Request::Read { .. } => self.reads.lock().unwrap().clone(),
            Request::Activate { .. } => self.activations.lock().unwrap().clone(),
            _ => self.others.lock().unwrap().clone(),
        };
        let ok = self.ok(&req);
        self.log.lock().unwrap().push(req);
        match answer {
            Answer::Ok => Box::pin(async move { ok }),
            Answer::Err(e) => Box::pin(async move { (Response::Err(e), Bytes::new()) }),
            Answer::Hang => Box::pin(std::future::pending()),
        }
    }
}

/// The directory: at generation 1, records what it is told.
pub(super) struct FakeDir {
    pub(super) generation: AtomicU64,
    pub(super) states: Mutex<Vec<(u64, ComponentState)>>,
    /// Refuse everything: a newer owner took over.
    pub(super) conflict: AtomicBool,
    /// Hold every request to record a copy active until
    /// [`FakeDir::answer_active`]: a resync's finish left in flight.
    pub(super) hold_active: AtomicBool,
    active_answered: tokio::sync::Notify,
    /// The ends of changes proposed, in order.
    pub(super) ends: Mutex<Vec<ChangeEnd>>,
    /// Refuse commits (an added copy was recorded failed).
    pub(super) refuse_commit: AtomicBool,
    /// The rebuilds asked for, in order.
    pub(super) rebuilds: Mutex<Vec<Vec<u64>>>,
    /// Refuse rebuilds with this reason (no domain or space left).
    pub(super) refuse_rebuild: Mutex<Option<String>>,
}

impl FakeDir {
    /// Lets the held request to record a copy active answer.
    pub(super) fn answer_active(&self) {
        self.active_answered.notify_one();
    }

    /// The states recorded so far, in the order their requests answered.
    pub(super) fn recorded(&self) -> Vec<(u64, ComponentState)> {
        self.states.lock().unwrap().clone()
    }
}

impl Control for FakeDir {
    async fn set_component_state(
        &self,
        _volume: VolumeId,
        component: u64,
        state: ComponentState,
        generation: Generation,
    ) -> Result<(), ControlError> {
        if state == ComponentState::Active && self.hold_active.load(Ordering::SeqCst) {
            self.active_answered.notified().await;
        }
        if self.conflict.load(Ordering::SeqCst)
            || generation != self.generation.load(Ordering::SeqCst)
        {
            return Err(ControlError::Conflict);
        }
        self.states.lock().unwrap().push((component, state));
        Ok(())
    }

    async fn reclaim(
        &self,
        _volume: VolumeId,
        expected: Generation,
    ) -> Result<Generation, ControlError> {
        if self.conflict.load(Ordering::SeqCst) {
            return Err(ControlError::Conflict);
        }
        self.generation
            .compare_exchange(expected, expected + 1, Ordering::SeqCst, Ordering::SeqCst)
            .map(|g| g + 1)
            .map_err(|_| ControlError::Conflict)
    }

    async fn end_reconfig(
        &self,
        _volume: VolumeId,
        generation: Generation,
        end: ChangeEnd,
    ) -> Result<(), ControlError> {
        if generation != self.generation.load(Ordering::SeqCst) {
            return Err(ControlError::Conflict);
        }
        let refused = end.commit && self.refuse_commit.load(Ordering::SeqCst);
        self.ends.lock().unwrap().push(end);
        if refused {
            return Err(ControlError::Refused("an added copy is absent".into()));
        }
        Ok(())
    }

    async fn commit_growth(
        &self,
        _volume: VolumeId,
        _generation: Generation,
        _size: u64,
        _map_log_at: Option<u64>,
    ) -> Result<(), ControlError> {
        Err(ControlError::Refused(
            "the RAID-1 loop's tests grow no erasure-coded volume".into(),
        ))
    }

    async fn begin_rebuild(
        &self,
        _volume: VolumeId,
        generation: Generation,
        components: Vec<u64>,
    ) -> Result<(), ControlError> {
        if generation != self.generation.load(Ordering::SeqCst) {
            return Err(ControlError::Conflict);
        }
        self.rebuilds.lock().unwrap().push(components);
        match self.refuse_rebuild.lock().unwrap().clone() {
            Some(why) => Err(ControlError::Refused(why)),
            None => Ok(()),
        }
    }
}

/// One replica of a rig.
#[derive(Clone, Copy)]
pub(super) struct Spec {
    role: ComponentRole,
    node: u64,
    mode: Mode,
    connected: bool,
    fill: u8,
}

/// A data copy on `node` (node 1 is the owner's) whose reads answer
/// `fill` bytes; connected unless it is out.
pub(super) fn copy(node: u64, mode: Mode, fill: u8) -> Spec {
    Spec {
        role: ComponentRole::Data,
        node,
        mode,
        connected: mode != Mode::Out,
        fill,
    }
}

pub(super) fn witness(node: u64) -> Spec {
    Spec {
        role: ComponentRole::Witness,
        node,
        mode: Mode::Out,
        connected: true,
        fill: 0,
    }
}

impl Spec {
    pub(super) fn disconnected(self) -> Spec {
        Spec {
            connected: false,
            ..self
        }
    }
}

/// Two in-sync copies (the first on the owner's node, reads 1s; the
/// second reads 2s) and a witness: components 1, 2, 3.
pub(super) fn standard() -> [Spec; 3] {
    [
        copy(1, Mode::InSync, 1),
        copy(2, Mode::InSync, 2),
        witness(3),
    ]
}

/// A loop over fake replicas, fed by hand.
pub(super) struct Rig {
    pub(super) lp: Loop<FakeDir>,
    rx: mpsc::UnboundedReceiver<Event>,
    pub(super) fakes: Vec<Arc<FakeReplica>>,
    pub(super) dir: Arc<FakeDir>,
    pub(super) route: ReadRoute,
}

pub(super) type Answered = oneshot::Receiver<Result<Bytes, OwnerError>>;

/// A fake replica whose reads answer `fill` bytes, reachable at the
/// address returned.
pub(super) fn fake_replica(fill: u8) -> (String, Arc<FakeReplica>) {
    static NEXT_ADDR: AtomicU64 = AtomicU64::new(0);
    let fake = Arc::new(FakeReplica {
        fill,
        ..FakeReplica::default()
    });
    let addr = format!(
        "owner-loop-test-{}",
        NEXT_ADDR.fetch_add(1, Ordering::SeqCst)
    );
    shoal_rpc::register_local(&addr, fake.clone());
    (addr, fake)
}

pub(super) async fn rig(specs: &[Spec]) -> Rig {
    rig_sized(specs, SIZE).await
}

/// [`rig`] over a volume of `size` bytes.
pub(super) async fn rig_sized(specs: &[Spec], size: u64) -> Rig {
    let dir = Arc::new(FakeDir {
        generation: AtomicU64::new(1),
        states: Mutex::default(),
        conflict: AtomicBool::new(false),
        hold_active: AtomicBool::new(false),
        active_answered: tokio::sync::Notify::new(),
        ends: Mutex::default(),
        refuse_commit: AtomicBool::new(false),
        rebuilds: Mutex::default(),
        refuse_rebuild: Mutex::default(),
    });
    let mut replicas = Vec::new();
    let mut fakes = Vec::new();
    for (i, s) in specs.iter().enumerate() {
        let (addr, fake) = fake_replica(s.fill);
        let peer = if s.connected {
            Some(Arc::new(
                Peer::connect(
                    &addr,
                    Duration::from_secs(1),
                    &shoal_rpc::PeerAuth::Unauthenticated,
                )
                .await
                .unwrap(),
            ))
        } else {
            None
        };
        replicas.push(Replica {
            role: s.role,
            component: i as u64 + 1,
            node: s.node,
            votes: 1,
            device: 1,
            addr,
            node_up: true,
            witness_ok: s.role == ComponentRole::Witness && s.connected,
            peer,
            mode: s.mode,
            pinging: false,
            reconnecting: false,
            probing: false,
            degraded: false,
            layouts: Layouts::BOTH,
            out_since: (s.mode == Mode::Out).then(std::time::Instant::now),
        });
        fakes.push(fake);
    }
    let cfg = OwnerConfig {
        node: 1,
        io_timeout: Duration::from_millis(IO_TIMEOUT_MS),
        tick: Duration::from_millis(50),
        io_wait: Duration::from_secs(5),
        peer_auth: shoal_rpc::PeerAuth::Unauthenticated,
    };
    let route = ReadRoute::default();
    // The loop holds a lease, as after its activation.
    let lease = Arc::new(crate::lease::Lease::default());
    lease.renewed(std::time::Instant::now());
    let shared = super::super::Shared {
        route: route.clone(),
        lease,
        status: Default::default(),
        latency: Default::default(),
        generation: Arc::new(std::sync::atomic::AtomicU64::new(1)),
        ended: Default::default(),
    };
    let (mut lp, rx) = Loop::new(cfg, dir.clone(), shared, 7, size, 1, replicas);
    lp.publish_route();
    lp.check_invariants(Flow::Continue);
    Rig {
        lp,
        rx,
        fakes,
        dir,
        route,
    }
}

pub(super) fn write(offset: u64, len: usize, byte: u8) -> Op {
    Op::Write {
        offset,
        data: Bytes::from(vec![byte; len]),
    }
}

impl Rig {
    /// Hands the loop a client operation; its answer to come.
    pub(super) fn submit(&mut self, op: Op) -> Answered {
        let (tx, rx) = oneshot::channel();
        assert_eq!(self.lp.apply(Event::Io(op, tx)), Flow::Continue);
        rx
    }

    pub(super) fn internal(&mut self, ev: Internal) -> Flow {
        self.lp.apply(Event::Internal(ev))
    }

    pub(super) fn tick(&mut self) -> Flow {
        self.internal(Internal::Tick)
    }

    /// Applies the next write whose copies all answered.
    pub(super) async fn finish_write(&mut self) -> Flow {
        let wait = Duration::from_millis(EVENT_WAIT_MS);
        let done = tokio::time::timeout(wait, self.lp.writes.next())
            .await
            .expect("a write finishes")
            .expect("a write is in flight");
        self.lp.apply(Event::Internal(done))
    }

    /// The next event the loop's tasks report, not yet applied.
    /// The next event the loop's tasks report; lease renewals (which
    /// every tick starts) are applied on the way, not returned.
    pub(super) async fn next_event(&mut self) -> Event {
        let wait = Duration::from_millis(EVENT_WAIT_MS);
        loop {
            let ev = tokio::time::timeout(wait, self.rx.recv())
                .await
                .expect("an event comes")
                .expect("the loop's channel is open");
            if matches!(ev, Event::Internal(Internal::Renewed { .. })) {
                assert_eq!(self.lp.apply(ev), Flow::Continue);
                continue;
            }
            return ev;
        }
    }

    /// Lets the tasks the loop spawned run (without applying what they
    /// report).
    pub(super) async fn settle(&self) {
        tokio::time::sleep(Duration::from_millis(SETTLE_MS)).await;
    }

    pub(super) async fn step(&mut self) -> Flow {
        let ev = self.next_event().await;
        self.lp.apply(ev)
    }

    /// Applies reported events until `done` holds; each must leave the
    /// loop running.
    pub(super) async fn run_until(&mut self, done: impl Fn(&Loop<FakeDir>) -> bool) {
        for _ in 0..MAX_STEPS {
            if done(&self.lp) {
                return;
            }
            assert_eq!(self.step().await, Flow::Continue, "the loop stopped");
        }
        panic!("state not reached in {MAX_STEPS} events");
    }

    /// Applies reported events until one stops the loop.
    pub(super) async fn run_until_stopped(&mut self) {
        for _ in 0..MAX_STEPS {
            if self.step().await == Flow::Stop {
                return;
            }
        }
        panic!("the loop did not stop in {MAX_STEPS} events");
    }

    pub(super) fn requests(&self, i: usize) -> Vec<Request> {
        self.fakes[i].requests()
    }

    /// Whether the shared read route (what `Owner` handles read) is set.
    pub(super) fn route_published(&self) -> bool {
        self.route.read().unwrap().is_some()
    }
}

/// Waits for an operation's answer (reads answer from their own task).
pub(super) async fn answer(rx: Answered) -> Result<Bytes, OwnerError> {
    tokio::time::timeout(Duration::from_millis(EVENT_WAIT_MS), rx)
        .await
        .expect("an answer comes")
        .expect("the operation is answered")
}

/// The answer already given, if any.
pub(super) fn answered(rx: &mut Answered) -> Option<Result<Bytes, OwnerError>> {
    rx.try_recv().ok()
}
