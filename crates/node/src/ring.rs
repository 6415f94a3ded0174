//! One device's reads on an io_uring driven by the async runtime.
//!
//! A read is located in the store's index on the runtime thread that asks
//! for it ([`LogStore::plan_read`]), its device reads go straight into
//! this ring (one `io_uring_enter`, no other thread involved; the device is
//! registered with the ring), and each read is answered as soon as its own
//! completions are in, with the plan's device buffer itself when the device
//! served all of it ([`LogStore::finish_read`]): the ring's
//! eventfd wakes a reaping task on the runtime. The device sees every
//! read the clients have in flight, and no thread hand-off or wake-up is
//! paid per read (the reader threads this replaces kept at most two
//! batches at the device and answered a batch only when all of it was
//! read).
//!
//! Where the runtime has a single worker (nodes that share a host, as
//! `shoal up` starts them), the ring is set up with
//! `IORING_SETUP_DEFER_TASKRUN`: the kernel leaves the completions' work
//! to the reaper, which runs it for every read that landed in one call,
//! instead of running it inside each submission. That worker is then the
//! only thread allowed on the ring; a read asked for on another thread is
//! done the plain way ([`ReadRing::here`]).
//!
//! Memory safety: the kernel writes into a plan's buffer until that read
//! completes, so a submitted plan belongs to the ring until then. It goes
//! back to the caller with the result, or is dropped by the reaper if the
//! caller has gone away (a client disconnecting mid-read). The ring and
//! its eventfd live as long as a read is in flight.
//!
//! Owns only the ring and what is in flight on it; what is read and how
//! it is checked is the store's.

use io_uring::{opcode, types, IoUring};
use shoal_store::ReadPlan;
use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex};
use tokio::io::unix::AsyncFd;
use tokio::sync::oneshot;

/// Submission queue entries of the ring (and most device reads in flight
/// at once): more than the reads a few clients keep at queue depth 32,
/// each usually one device read (plus, rarely, a header). Reads beyond it
/// wait in the ring's backlog.
const DEPTH: u32 = 256;

/// Most rounds of a deferred ring's reaping in one turn of the reaper (see
/// `reap`); then it yields and comes back.
const MAX_REAP_ROUNDS: usize = 16;

/// What a submitted plan gives back: the plan (its buffer filled) and
/// whether every device read succeeded. An error of kind
/// [`io::ErrorKind::UnexpectedEof`] means a read came back short; the
/// caller redoes it with plain reads.
pub type Done = (ReadPlan, io::Result<()>);

struct Pending {
    plan: ReadPlan,
    /// (device byte offset, address in the plan's buffer, length).
    parts: Vec<(u64, *mut u8, usize)>,
    /// Parts handed to the kernel so far.
    sent: usize,
    /// Parts not yet completed.
    left: usize,
    err: Option<io::Error>,
    reply: oneshot::Sender<Done>,
}

// SAFETY: the raw pointers point into `plan`'s own heap buffer, which
// moves with it; they are only handed to the kernel and never
// dereferenced by this code.
unsafe impl Send for Pending {}

struct State {
    ring: IoUring,
    slots: Vec<Option<Pending>>,
    free: Vec<usize>,
    /// Slots with parts not yet submitted (the queue was full).
    backlog: VecDeque<usize>,
    /// Parts at the kernel (or queued for the next submission).
    at_kernel: usize,
    stop: bool,
}

/// How reads name the device: registered with the ring (the kernel then
/// skips looking the descriptor up and taking a reference to it for every
/// read), or by its descriptor where registering was refused.
#[derive(Clone, Copy)]
enum DevFile {
    Registered,
    Fd(RawFd),
}

struct Shared {
    /// Keeps the device's descriptor open while the ring may use it.
    _keep: Arc<dyn Send + Sync>,
    file: DevFile,
    /// Set up with `IORING_SETUP_DEFER_TASKRUN`: only `issuer` may
    /// submit and reap.
    deferred: bool,
    /// The thread that enabled a deferred ring (the reaper's, on its first
    /// run); unset before that. Read without the state lock on every read.
    issuer: std::sync::OnceLock<std::thread::ThreadId>,
    state: Mutex<State>,
    event: AsyncFd<OwnedFd>,
}

// Rings are set up with `IORING_SETUP_DEFER_TASKRUN` where the runtime has
// a single worker (a node sharing its host with others, as in `shoal up`),
// else with `IORING_SETUP_COOP_TASKRUN`: completions then run in the
// reaper's calls, not in each submission's, which measured faster
// (bench/RESULTS.md, 2026-12-01, read completions run by the reaper).

/// Whether the current runtime runs its tasks on one thread (a
/// current-thread runtime, or a multi-thread one with one worker): the
/// ring's reaper and every read then run on that thread.
fn one_worker() -> bool {
    tokio::runtime::Handle::try_current().is_ok_and(|h| h.metrics().num_workers() == 1)
}

/// Whether the running kernel is at least `major.minor`.
pub(crate) fn kernel_at_least(major: u32, minor: u32) -> bool {
    let Ok(r) = std::fs::read_to_string("/proc/sys/kernel/osrelease") else {
        return false;
    };
    let mut it = r
        .trim()
        .split(|c: char| !c.is_ascii_digit())
        .map(|x| x.parse::<u32>().unwrap_or(0));
    let (a, b) = (it.next().unwrap_or(0), it.next().unwrap_or(0));
    (a, b) >= (major, minor)
}

impl Shared {
    /// Whether the calling thread may submit to and reap the ring: any
    /// thread for a plain ring, only the issuer for a deferred one.
    fn may_use_here(&self) -> bool {
        !self.deferred || self.issuer.get() == Some(&std::thread::current().id())
    }
}

/// A device's read ring. Dropping it stops the reaper once nothing is in
/// flight.
pub struct ReadRing {
    shared: Arc<Shared>,
}

fn lock(m: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl ReadRing {
    /// A ring reading `dev_fd`, reaped on the current runtime; `keep`
    /// (the store) holds `dev_fd` open, and is held as long as the ring is.
    pub fn start(dev_fd: RawFd, keep: Arc<dyn Send + Sync>) -> io::Result<ReadRing> {
        let deferred = one_worker() && kernel_at_least(6, 2);
        let built = if deferred {
            // Completions are run only when the reaper asks for them, all
            // that landed in one call, never as part of a submission. The
            // kernel then requires one thread to do all the submitting
            // and reaping: the runtime's only worker, which the reaper
            // enables the ring from (see `reap`). The eventfd still fires
            // when a completion lands (kernels from 6.2).
            IoUring::builder()
                .setup_defer_taskrun()
                .setup_single_issuer()
                .setup_r_disabled()
                .build(DEPTH)
                .ok()
        } else {
            None
        };
        let deferred = built.is_some();
        let ring = if let Some(r) = built {
            r
        } else {
            // Completions run when this thread next enters the kernel (it
            // does so for every request anyway), or wake it from its
            // wait, instead of interrupting it in user space for each
            // one: less of the runtime thread per read (bench/RESULTS.md,
            // 2026-12-01, read completions without interrupts). Kernels
            // before 5.19 refuse the flag: a plain ring then.
            IoUring::builder()
                .setup_coop_taskrun()
                .build(DEPTH)
                .or_else(|_| IoUring::new(DEPTH))?
        };
        // SAFETY: plain system call; the result is checked.
        let efd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if efd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a new descriptor that nothing else owns.
        let efd = unsafe { OwnedFd::from_raw_fd(efd) };
        ring.submitter().register_eventfd(efd.as_raw_fd())?;
        let file = match ring.submitter().register_files(&[dev_fd]) {
            Ok(()) => DevFile::Registered,
            Err(e) => {
                tracing::debug!(error = %e, "device not registered with its read ring");
                DevFile::Fd(dev_fd)
            }
        };
        // SAFETY: the eventfd is owned by the AsyncFd from here on, and
        // stays open (the same descriptor) until it is dropped.
        let event = unsafe { AsyncFd::register_with_interest(efd, tokio::io::Interest::READABLE) }
            .map_err(|e| io::Error::other(e.to_string()))?;
        let shared = Arc::new(Shared {
            _keep: keep,
            file,
            deferred,
            issuer: std::sync::OnceLock::new(),
            state: Mutex::new(State {
                ring,
                slots: Vec::new(),
                free: Vec::new(),
                backlog: VecDeque::new(),
                at_kernel: 0,
                stop: false,
            }),
            event,
        });
        tokio::spawn(reap(shared.clone()));
        Ok(ReadRing { shared })
    }

    /// Whether the ring was set up with `IORING_SETUP_DEFER_TASKRUN`.
    pub fn deferred(&self) -> bool {
        self.shared.deferred
    }

    /// Whether reads name the device as a file registered with the ring.
    pub fn registered(&self) -> bool {
        matches!(self.shared.file, DevFile::Registered)
    }

    /// Whether this thread may submit to the ring. A deferred ring takes
    /// submissions only from the thread that enabled it; a caller on any
    /// other thread (or before the reaper first ran) reads the plain way.
    pub fn here(&self) -> bool {
        self.shared.may_use_here()
    }

    /// Submits the device reads of `plan` (which has some) at once. The
    /// answer comes when all of them have completed. (Gathering a burst
    /// of reads into one system call measured slower: bench/RESULTS.md,
    /// 2026-12-01, reads on the runtime's ring.)
    pub fn submit(&self, mut plan: ReadPlan) -> io::Result<oneshot::Receiver<Done>> {
        let parts = plan.raw_parts();
        assert!(!parts.is_empty(), "a plan without device reads");
        let (tx, rx) = oneshot::channel();
        let mut st = lock(&self.shared.state);
        if st.stop {
            return Err(io::Error::other("device read ring stopped"));
        }
        if !self.shared.may_use_here() {
            return Err(io::Error::new(
                io::ErrorKind::WouldBlock,
                "device read ring: not its thread",
            ));
        }
        let slot = match st.free.pop() {
            Some(s) => s,
            None => {
                st.slots.push(None);
                st.slots.len() - 1
            }
        };
        st.slots[slot] = Some(Pending {
            plan,
            left: parts.len(),
            parts,
            sent: 0,
            err: None,
            reply: tx,
        });
        st.backlog.push_back(slot);
        // On an error the entries stay queued (the reaper retries the
        // submission when a completion comes in); the caller gives up on
        // this read, whose plan stays here until the kernel is done.
        push_backlog(&mut st, self.shared.file)?;
        Ok(rx)
    }
}

impl Drop for ReadRing {
    fn drop(&mut self) {
        lock(&self.shared.state).stop = true;
        // Wake the reaper so it sees `stop`.
        poke(self.shared.event.get_ref().as_raw_fd());
    }
}

fn poke(efd: RawFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a valid u64 to our own eventfd.
    unsafe { libc::write(efd, (&one as *const u64).cast(), 8) };
}

/// Moves backlog parts into the submission queue while the kernel has
/// room for them, then submits.
fn push_backlog(st: &mut State, file: DevFile) -> io::Result<()> {
    let mut pushed = false;
    while let Some(&slot) = st.backlog.front() {
        if st.at_kernel >= DEPTH as usize {
            break;
        }
        let State {
            ring,
            slots,
            at_kernel,
            backlog,
            ..
        } = st;
        let Some(p) = slots[slot].as_mut() else {
            backlog.pop_front();
            continue;
        };
        let mut sq = ring.submission();
        while p.sent < p.parts.len() && *at_kernel < DEPTH as usize && !sq.is_full() {
            let (off, ptr, len) = p.parts[p.sent];
            let e = match file {
                DevFile::Registered => opcode::Read::new(types::Fixed(0), ptr, len as u32),
                DevFile::Fd(fd) => opcode::Read::new(types::Fd(fd), ptr, len as u32),
            }
            .offset(off)
            .build()
            .user_data(((slot as u64) << 24) | p.sent as u64);
            // SAFETY: the buffer is the plan's, kept in this slot until the
            // completion of this entry is reaped.
            if unsafe { sq.push(&e) }.is_err() {
                break;
            }
            p.sent += 1;
            *at_kernel += 1;
            pushed = true;
        }
        drop(sq);
        if p.sent < p.parts.len() {
            break;
        }
        backlog.pop_front();
    }
    if !pushed {
        return Ok(());
    }
    loop {
        match st.ring.submit() {
            Ok(_) => return Ok(()),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR) | Some(libc::EAGAIN)) => {
                continue
            }
            Err(e) => {
                // The entries stay queued and go with the next submission;
                // the reads already in flight complete as usual.
                tracing::warn!(error = %e, "io_uring submission failed");
                return Err(e);
            }
        }
    }
}

/// Reaps completions whenever the eventfd fires and answers the reads
/// that are complete.
async fn reap(sh: Arc<Shared>) {
    if sh.deferred {
        // This thread (the runtime's only worker) submits and reaps from
        // now on.
        match lock(&sh.state).ring.submitter().register_enable_rings() {
            Ok(()) => {
                let _ = sh.issuer.set(std::thread::current().id());
            }
            // Nothing was submitted: every read goes the plain way
            // (`here` stays false).
            Err(e) => tracing::warn!(error = %e, "device read ring: cannot enable"),
        }
    }
    loop {
        let mut guard = match sh.event.readable().await {
            Ok(g) => g,
            Err(e) => {
                // Cannot wait any more: give up on new reads. Reads in
                // flight keep their buffers (leaked with the state).
                tracing::error!(error = %e, "device read ring: eventfd wait failed");
                lock(&sh.state).stop = true;
                std::mem::forget(sh);
                return;
            }
        };
        // Drain the eventfd until it would block (clearing readiness),
        // then the completion queue: a completion after the drain fires
        // the eventfd again.
        loop {
            let mut v: u64 = 0;
            let r = guard.try_io(|fd| {
                // SAFETY: reads 8 bytes into a valid u64.
                let n = unsafe { libc::read(fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
                if n < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(())
                }
            });
            if !matches!(r, Ok(Ok(()))) {
                break;
            }
        }
        let mut done = Vec::new();
        let finished = {
            let mut st = lock(&sh.state);
            let st = &mut *st;
            let deferred = sh.deferred && sh.issuer.get().is_some();
            if deferred && !sh.may_use_here() {
                // Cannot happen with one worker; the kernel would refuse
                // the calls below, and reads would time out.
                tracing::error!("device read ring reaped off its thread");
            }
            // A deferred ring: each call runs the completions' work that
            // is waiting, or a bounded part of it (the kernel may keep the
            // rest for the next call without firing the eventfd again),
            // so call until one posts nothing.
            let mut rounds = 0;
            loop {
                if deferred {
                    // SAFETY: no submission, no argument: runs the work of
                    // the completions that landed and posts them.
                    let _ = unsafe {
                        st.ring.submitter().enter::<libc::sigset_t>(
                            0, 0, 1, /* IORING_ENTER_GETEVENTS */
                            None,
                        )
                    };
                }
                let mut posted = 0usize;
                for cqe in st.ring.completion() {
                    posted += 1;
                    let slot = (cqe.user_data() >> 24) as usize;
                    let part = (cqe.user_data() & 0xff_ffff) as usize;
                    st.at_kernel = st.at_kernel.saturating_sub(1);
                    let Some(p) = st.slots.get_mut(slot).and_then(|s| s.as_mut()) else {
                        tracing::error!(slot, "device read ring: completion for no read");
                        continue;
                    };
                    let r = cqe.result();
                    let want = p.parts.get(part).map_or(0, |x| x.2);
                    if r < 0 {
                        p.err.get_or_insert(io::Error::from_raw_os_error(-r));
                    } else if r as usize != want {
                        p.err.get_or_insert(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            format!("short device read: {r} of {want} bytes"),
                        ));
                    }
                    p.left -= 1;
                    if p.left == 0 {
                        if let Some(p) = st.slots[slot].take() {
                            st.free.push(slot);
                            done.push(p);
                        }
                    }
                }
                if !deferred || posted == 0 {
                    break;
                }
                rounds += 1;
                if rounds == MAX_REAP_ROUNDS {
                    // Still busy: come back after the others had a turn.
                    poke(sh.event.get_ref().as_raw_fd());
                    break;
                }
            }
            if !st.backlog.is_empty() {
                let _ = push_backlog(st, sh.file);
            } else if !st.ring.submission().is_empty() {
                // Left queued by a failed submission: try again.
                let _ = st.ring.submit();
            }
            st.stop && st.at_kernel == 0
        };
        for p in done {
            let r = match p.err {
                Some(e) => Err(e),
                None => Ok(()),
            };
            // The caller may have gone: the plan is dropped here, after the
            // kernel is done with it.
            let _ = p.reply.send((p.plan, r));
        }
        if finished {
            // Answer what never reached the kernel.
            // (Nothing is at the kernel any more.)
            let mut st = lock(&sh.state);
            for s in st.slots.iter_mut() {
                if let Some(p) = s.take() {
                    let _ = p
                        .reply
                        .send((p.plan, Err(io::Error::other("device read ring stopped"))));
                }
            }
            return;
        }
    }
}
