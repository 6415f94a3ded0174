//! The life of the `shoal node` process: how it meets signals, panics and
//! its end. A node never dies without a word: every way out that can be
//! caught writes a line to its log (standard error) and to its exit
//! record, `DATA/node.exit`, and ends with an exit code that says why.
//!
//! | exit | why |
//! |---|---|
//! | 0 | stopped on request (SIGTERM, SIGINT, SIGQUIT) |
//! | 1 | could not start, or an essential part of the node ended (the reason is logged) |
//! | 70 | a panic: a bug, with its message and location in the log |
//! | 128 + N | killed by signal N; a caught fatal one (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT, SIGSYS, SIGXCPU) is logged first |
//!
//! SIGKILL and a power cut leave no record: the exit record then stays
//! empty, and `shoal status` says so.
//!
//! SIGPIPE is ignored: a write to a connection whose other end has gone
//! (a peer killed, a client gone) is an error on that connection only.
//! The short-lived commands keep the default (`shoal status | head`).

use std::io::Write;
use std::os::fd::IntoRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, Ordering};

/// Exit code of a node stopped on request.
pub const EXIT_STOPPED: i32 = 0;
/// Exit code of a node that could not start or whose essential part ended.
pub const EXIT_FAILED: i32 = 1;
/// Exit code of a node that panicked (`EX_SOFTWARE` of sysexits.h).
pub const EXIT_PANIC: i32 = 70;

/// The exit record's name in the node's data folder.
pub const EXIT_RECORD: &str = "node.exit";

/// Descriptor of the open exit record (-1 before [`start`]); a signal
/// handler writes to it, so it is opened before any can run.
static RECORD_FD: AtomicI32 = AtomicI32::new(-1);

/// Signals that end the process at once, caught only to be logged: the
/// handler writes a line and lets the signal take its default course.
const FATAL: [(libc::c_int, &str); 7] = [
    (libc::SIGSEGV, "SIGSEGV"),
    (libc::SIGBUS, "SIGBUS"),
    (libc::SIGILL, "SIGILL"),
    (libc::SIGFPE, "SIGFPE"),
    (libc::SIGABRT, "SIGABRT"),
    (libc::SIGSYS, "SIGSYS"),
    (libc::SIGXCPU, "SIGXCPU"),
];

/// Ignores SIGPIPE for the whole process: broken connections become
/// `EPIPE` errors on the write that met them.
pub fn ignore_sigpipe() {
    // SAFETY: setting a signal's disposition to SIG_IGN has no handler to
    // be unsafe in.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    }
}

/// Prepares the node's process: SIGPIPE ignored, the exit record of
/// `data_dir` emptied and kept open, panics and fatal signals logged.
/// Call once, before the runtime starts threads.
pub fn start(data_dir: &Path) -> std::io::Result<()> {
    ignore_sigpipe();
    std::fs::create_dir_all(data_dir)?;
    let f = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .open(record_path(data_dir))?;
    RECORD_FD.store(f.into_raw_fd(), Ordering::SeqCst);
    install_panic_hook();
    install_fatal_handlers();
    raise_descriptor_limit();
    Ok(())
}

/// Descriptors a node may need at once: every port's connection bound
/// (API 1,024, peer 512, NBD 1,024), its own connections to peers, device
/// files and threads' rings, with room to spare.
pub const DESCRIPTORS_NEEDED: u64 = 4096;

/// Raises the soft limit on open descriptors to the hard limit, so that
/// the ports' connection bounds, not the default soft limit (often 1,024),
/// decide when connections are refused; warns when even the hard limit is
/// below [`DESCRIPTORS_NEEDED`].
fn raise_descriptor_limit() {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain system calls with a valid, initialised struct.
    let got = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) } == 0;
    if !got {
        return;
    }
    if l.rlim_cur < l.rlim_max {
        let want = libc::rlimit {
            rlim_cur: l.rlim_max,
            rlim_max: l.rlim_max,
        };
        // SAFETY: as above.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &want) } == 0 {
            l.rlim_cur = l.rlim_max;
        }
    }
    if l.rlim_cur < DESCRIPTORS_NEEDED {
        tracing::warn!(
            limit = l.rlim_cur,
            needed = DESCRIPTORS_NEEDED,
            "the descriptor limit is below what the ports' connection bounds need: \
             connections will be refused before the bounds are reached"
        );
    }
}

pub fn record_path(data_dir: &Path) -> PathBuf {
    data_dir.join(EXIT_RECORD)
}

/// Writes `line` (and a newline) to the exit record, replacing what it
/// held. Only async-signal-safe calls: used from signal handlers too.
fn record(line: &[u8]) {
    let fd = RECORD_FD.load(Ordering::SeqCst);
    if fd < 0 {
        return;
    }
    // SAFETY: plain system calls on a descriptor this module owns, with
    // valid buffers.
    unsafe {
        libc::ftruncate(fd, 0);
        libc::pwrite(fd, line.as_ptr().cast(), line.len(), 0);
        libc::pwrite(fd, b"\n".as_ptr().cast(), 1, line.len() as libc::off_t);
        libc::fsync(fd);
    }
}

/// Ends the process with `code` after writing `why` to the log and the
/// exit record.
pub fn exit(code: i32, why: &str) -> ! {
    let line = format!("exit {code}: {why}");
    if code == EXIT_STOPPED {
        tracing::info!("{line}");
    } else {
        tracing::error!("{line}");
    }
    eprintln!("shoal node: {line}");
    record(line.as_bytes());
    let _ = std::io::stderr().flush();
    std::process::exit(code)
}

/// A panic anywhere (any thread, any task) ends the node with its message
/// and location: a node with a dead thread or task would go on half
/// alive, holding volumes it no longer serves.
fn install_panic_hook() {
    std::panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "(no message)".into());
        let at = info
            .location()
            .map(|l| format!("{}:{}:{}", l.file(), l.line(), l.column()))
            .unwrap_or_else(|| "an unknown place".into());
        let thread = std::thread::current();
        let thread = thread.name().unwrap_or("unnamed");
        let bt = std::backtrace::Backtrace::force_capture();
        eprintln!("shoal node: panic in thread {thread} at {at}: {msg}\n{bt}");
        exit(
            EXIT_PANIC,
            &format!("panic in thread {thread} at {at}: {msg}"),
        );
    }));
}

/// The handlers that were there before ours (Rust's own, which tells a
/// stack overflow from other faults), to be called after our line.
static mut PREVIOUS: [libc::sigaction; FATAL.len()] = unsafe { std::mem::zeroed() };

extern "C" fn on_fatal(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let Some(i) = FATAL.iter().position(|(s, _)| *s == sig) else {
        return;
    };
    let name = FATAL[i].1.as_bytes();
    // A fixed buffer: no allocation in a signal handler.
    let mut line = [0u8; 64];
    let prefix = b"killed by ";
    let n = prefix.len() + name.len();
    line[..prefix.len()].copy_from_slice(prefix);
    line[prefix.len()..n].copy_from_slice(name);
    // SAFETY: write(2) to standard error and the exit record are
    // async-signal-safe; the previous action was stored before ours was
    // installed and is only read here.
    unsafe {
        let msg = b"shoal node: exit by a fatal signal: ";
        libc::write(2, msg.as_ptr().cast(), msg.len());
        libc::write(2, line[..n].as_ptr().cast(), n);
        libc::write(2, b"\n".as_ptr().cast(), 1);
        record(&line[..n]);
        let prev = std::ptr::addr_of!(PREVIOUS[i]).read();
        if prev.sa_sigaction == libc::SIG_DFL || prev.sa_sigaction == libc::SIG_IGN {
            // Default course: restore it and raise again (a fault comes
            // back on return; SIGABRT and the others are re-raised).
            libc::signal(sig, libc::SIG_DFL);
            libc::raise(sig);
        } else {
            if prev.sa_flags & libc::SA_SIGINFO != 0 {
                let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                    std::mem::transmute(prev.sa_sigaction);
                f(sig, info, ctx);
            } else {
                let f: extern "C" fn(libc::c_int) = std::mem::transmute(prev.sa_sigaction);
                f(sig);
            }
            // The previous handler returned (Rust's does for a fault that
            // is not a stack overflow, expecting the fault to come back;
            // one sent by kill(2) would not): end the process all the same.
            libc::signal(sig, libc::SIG_DFL);
            libc::raise(sig);
        }
    }
}

fn install_fatal_handlers() {
    for (i, (sig, _)) in FATAL.iter().enumerate() {
        // SAFETY: sigaction with a handler that only makes
        // async-signal-safe calls; PREVIOUS is written before our handler
        // can run for this signal, and by this thread only.
        unsafe {
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = on_fatal as *const () as libc::sighandler_t;
            act.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_NODEFER;
            libc::sigemptyset(&mut act.sa_mask);
            let prev = std::ptr::addr_of_mut!(PREVIOUS[i]);
            libc::sigaction(*sig, std::ptr::null(), prev);
            libc::sigaction(*sig, &act, std::ptr::null_mut());
        }
    }
}

/// Resolves when the node is asked to stop (SIGTERM, SIGINT, SIGQUIT),
/// with the signal's name; logs and ignores SIGHUP, SIGUSR1 and SIGUSR2,
/// whose default would end the node without a word.
pub async fn stop_requested() -> std::io::Result<&'static str> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut quit = signal(SignalKind::quit())?;
    let mut hup = signal(SignalKind::hangup())?;
    let mut usr1 = signal(SignalKind::user_defined1())?;
    let mut usr2 = signal(SignalKind::user_defined2())?;
    loop {
        let ignored = tokio::select! {
            _ = term.recv() => return Ok("SIGTERM"),
            _ = int.recv() => return Ok("SIGINT"),
            _ = quit.recv() => return Ok("SIGQUIT"),
            _ = hup.recv() => "SIGHUP",
            _ = usr1.recv() => "SIGUSR1",
            _ = usr2.recv() => "SIGUSR2",
        };
        tracing::warn!("received {ignored}: ignored (it does not stop a node)");
    }
}

/// What a local node's exit record says, for `shoal status` and `shoal
/// up`: `None` when there is no record file at all (the node never ran
/// with this build).
pub fn last_exit(data_dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(record_path(data_dir)).ok()?;
    let line = text.trim();
    Some(if line.is_empty() {
        "ended without a word: killed by SIGKILL (or the OOM killer), or its host stopped".into()
    } else {
        line.to_string()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With SIGPIPE at its default (as `main` sets it for every command),
    /// the node's setting makes a write to a socket whose peer has closed
    /// an error for the caller, not the end of the process. Without
    /// [`ignore_sigpipe`] this test's process is killed by the signal.
    #[test]
    fn a_write_to_a_closed_socket_is_an_error_and_the_process_lives() {
        // SAFETY: as in main.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
        ignore_sigpipe();
        // A Unix socket pair: plain write(2), no MSG_NOSIGNAL.
        let (mut a, b) = std::os::unix::net::UnixStream::pair().expect("pair");
        drop(b);
        let mut last = Ok(0);
        for _ in 0..4 {
            last = a.write(b"data");
            if last.is_err() {
                break;
            }
        }
        let e = last.expect_err("a write to a closed socket fails");
        assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe, "{e}");

        // And through tokio's vectored writes on TCP (writev, no flag),
        // the way the node's connections write.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            use tokio::io::AsyncWriteExt;
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = l.local_addr().unwrap();
            let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
            let (s, _) = l.accept().await.unwrap();
            drop(s);
            let mut failed = None;
            for _ in 0..100 {
                let bufs = [
                    std::io::IoSlice::new(b"head"),
                    std::io::IoSlice::new(b"body"),
                ];
                if let Err(e) = c.write_vectored(&bufs).await {
                    failed = Some(e);
                    break;
                }
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            let e = failed.expect("writes to a closed TCP connection fail");
            assert!(
                matches!(
                    e.kind(),
                    std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
                ),
                "{e}"
            );
        });
    }

    /// Set in the child process of the panic test: the folder of its
    /// exit record.
    const PANIC_CHILD: &str = "SHOAL_TEST_PANIC_CHILD";

    /// A panic on any thread ends the process with [`EXIT_PANIC`], its
    /// message and location on standard error and in the exit record. The
    /// test runs itself again as a child process that panics.
    #[test]
    fn a_panic_on_any_thread_is_logged_recorded_and_ends_the_process() {
        if let Ok(dir) = std::env::var(PANIC_CHILD) {
            start(Path::new(&dir)).expect("start");
            let t = std::thread::Builder::new()
                .name("doomed".into())
                .spawn(|| panic!("boom {}", 42))
                .expect("thread");
            let _ = t.join();
            // The hook ends the process before the join returns.
            std::process::exit(3);
        }
        let dir = tempfile::tempdir().expect("tmp");
        let out = std::process::Command::new(std::env::current_exe().expect("exe"))
            .args([
                "daemon::tests::a_panic_on_any_thread_is_logged_recorded_and_ends_the_process",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(PANIC_CHILD, dir.path())
            .output()
            .expect("child");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(EXIT_PANIC), "{err}");
        assert!(err.contains("panic in thread doomed at"), "{err}");
        assert!(err.contains("daemon.rs:"), "{err}");
        assert!(err.contains("boom 42"), "{err}");
        let rec = last_exit(dir.path()).expect("a record");
        assert!(
            rec.starts_with("exit 70: panic in thread doomed at"),
            "{rec}"
        );
        assert!(rec.ends_with("boom 42"), "{rec}");
    }

    #[test]
    fn the_exit_record_tells_an_empty_record_from_a_reason() {
        let dir = tempfile::tempdir().expect("tmp");
        assert_eq!(last_exit(dir.path()), None);
        std::fs::write(record_path(dir.path()), "").unwrap();
        assert!(last_exit(dir.path()).unwrap().contains("SIGKILL"));
        std::fs::write(
            record_path(dir.path()),
            "exit 70: panic at x.rs:1:1: boom\n",
        )
        .unwrap();
        assert_eq!(
            last_exit(dir.path()).unwrap(),
            "exit 70: panic at x.rs:1:1: boom"
        );
    }
}
