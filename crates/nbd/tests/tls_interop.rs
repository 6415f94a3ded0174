//! NBD over TLS with the real clients installed here: libnbd's `nbdinfo`
//! and qemu's `qemu-io` / `qemu-img` (gnutls on their side), against
//! `serve` with TLS required and certificates made by shoal-tls, as a
//! node and its NBD clients hold them, or pre-shared keys made by
//! GnuTLS's `psktool` (TLS-PSK). A missing tool fails the test with the
//! package to install: these checks must not pass unseen.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;

use shoal_nbd::mem::{MemDisk, MemExports};
use shoal_nbd::{serve, NbdTls, PskConfig, PskKeys};
use shoal_tls::{
    issue, new_ca, CaMaterial, ClientAuth, ClientCredentials, KeyRequest, NodeCredentials, Subject,
};
use tokio::sync::oneshot;

const EXPORT: &str = "tlsdisk";
/// Size of the export, bytes: small, it is held in memory.
const SIZE: usize = 16 << 20;
/// Seconds one run of a tool may take (it takes well under one): passed
/// to coreutils `timeout`, which kills it after.
const TOOL_TIMEOUT_S: u64 = 60;
/// coreutils `timeout`'s exit status when it had to stop the tool.
const TIMED_OUT: i32 = 124;

/// `serve` with TLS required, on a free port of 127.0.0.1, in a runtime
/// of its own thread; stopped (and its connections dropped) on drop.
struct Server {
    addr: SocketAddr,
    disk: Arc<MemDisk>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    fn start(tls: NbdTls) -> Server {
        // The server's log (each refusal says why), shown with a failure.
        let _ = tracing_subscriber::fmt()
            .with_env_filter("shoal_nbd=debug")
            .with_test_writer()
            .try_init();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        listener
            .set_nonblocking(true)
            .expect("non-blocking listener");
        let addr = listener.local_addr().expect("local address");
        let mut exports = MemExports::new();
        let disk = exports.add(EXPORT, SIZE);
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let l = tokio::net::TcpListener::from_std(listener).expect("tokio listener");
                let stopped = async move {
                    let _ = stopped.await;
                };
                serve(l, Arc::new(exports), stopped, tls)
                    .await
                    .expect("serve");
            });
        });
        Server {
            addr,
            disk,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    fn port(&self) -> u16 {
        self.addr.port()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A cluster: its CA and the server configuration of a node it
/// certified for 127.0.0.1 (requiring a client certificate of the CA).
struct Cluster {
    id: String,
    ca: CaMaterial,
    server: Arc<rustls::ServerConfig>,
}

fn cluster(id: &str) -> Cluster {
    let ca = new_ca(id).expect("CA");
    let req = KeyRequest::new().expect("key");
    let subject = Subject::Node {
        id: 1,
        addrs: vec![IpAddr::V4(Ipv4Addr::LOCALHOST)],
    };
    let cert = issue(&ca, id, &req.csr_pem, &subject).expect("node certificate");
    let creds = NodeCredentials::from_pem(&ca.cert_pem, &cert, &req.key_pem).expect("node creds");
    let server = creds
        .server_config(ClientAuth::Required)
        .expect("server config");
    Cluster {
        id: id.to_string(),
        ca,
        server,
    }
}

/// A client's TLS directory (`ca-cert.pem`, `client-cert.pem`,
/// `client-key.pem`) under `root`: it trusts `trusted`'s CA and holds a
/// client certificate of `issuer`'s.
fn client_dir(root: &Path, name: &str, trusted: &Cluster, issuer: &Cluster) -> PathBuf {
    let req = KeyRequest::new().expect("key");
    let subject = Subject::Client {
        name: name.to_string(),
    };
    let cert = issue(&issuer.ca, &issuer.id, &req.csr_pem, &subject).expect("client certificate");
    let dir = root.join(name);
    ClientCredentials::save(&dir, &trusted.ca.cert_pem, &cert, &req.key_pem).expect("save");
    dir
}

/// The full path of `bin`, or a failure saying which package has it.
fn tool(bin: &str, package: &str) -> PathBuf {
    let found = std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(bin))
            .find(|f| f.is_file())
    });
    found.unwrap_or_else(|| {
        panic!(
            "{bin} is needed by the NBD TLS interop tests and is not installed (package {package})"
        )
    })
}

/// Runs `bin args`, at most [`TOOL_TIMEOUT_S`].
fn run(bin: &Path, args: &[&str]) -> Output {
    let out = Command::new(tool("timeout", "coreutils"))
        .arg("--kill-after=5")
        .arg(TOOL_TIMEOUT_S.to_string())
        .arg(bin)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{} could not be started: {e}", bin.display()));
    assert_ne!(
        out.status.code(),
        Some(TIMED_OUT),
        "{} {args:?} did not finish in {TOOL_TIMEOUT_S} s",
        bin.display()
    );
    out
}

fn show(out: &Output) -> String {
    format!(
        "{}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn nbds_uri(srv: &Server, dir: &Path) -> String {
    format!(
        "nbds://127.0.0.1:{}/{EXPORT}?tls-certificates={}",
        srv.port(),
        dir.display()
    )
}

/// libnbd over TLS with a client certificate of the cluster.
#[test]
fn nbdinfo_over_tls_shows_the_size() {
    let nbdinfo = tool("nbdinfo", "libnbd-bin");
    let c = cluster("c1");
    let srv = Server::start(NbdTls::Require(c.server.clone().into()));
    let tmp = tempfile::tempdir().expect("temp dir");
    let dir = client_dir(tmp.path(), "good", &c, &c);
    let out = run(&nbdinfo, &[&nbds_uri(&srv, &dir)]);
    assert!(out.status.success(), "nbdinfo failed: {}", show(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(&SIZE.to_string()), "no size: {}", show(&out));
    let out = run(&nbdinfo, &["--size", &nbds_uri(&srv, &dir)]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        SIZE.to_string()
    );
}

/// `qemu-io` over TLS (`tls-creds-x509` reading `dir`): writes a pattern
/// and reads it back.
fn qemu_io_pattern(srv: &Server, dir: &Path) -> Output {
    let qemu_io = tool("qemu-io", "qemu-utils");
    let creds = format!(
        "tls-creds-x509,id=tls0,endpoint=client,dir={}",
        dir.display()
    );
    let image = format!(
        "driver=nbd,server.type=inet,server.host=127.0.0.1,server.port={},\
         export={EXPORT},tls-creds=tls0",
        srv.port()
    );
    let (write, read) = ("write -P 0x5a 0 64k", "read -P 0x5a 0 64k");
    let args = [
        "--object",
        &creds,
        "--image-opts",
        "-c",
        write,
        "-c",
        read,
        &image,
    ];
    run(&qemu_io, &args)
}

fn assert_pattern_written(srv: &Server, out: &Output) {
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "qemu-io failed: {}", show(out));
    assert!(!text.contains("failed"), "{}", show(out));
    assert!(text.contains("read 65536/65536 bytes"), "{}", show(out));
    let snap = srv.disk.snapshot();
    assert!(snap[..64 << 10].iter().all(|&b| b == 0x5a), "not written");
}

/// qemu over TLS with the cluster's client certificate, with qemu's own
/// certificate checks on (its default): a pattern written and read back.
#[test]
fn qemu_io_over_tls_writes_and_reads_back() {
    let c = cluster("c1");
    let srv = Server::start(NbdTls::Require(c.server.clone().into()));
    let tmp = tempfile::tempdir().expect("temp dir");
    let dir = client_dir(tmp.path(), "good", &c, &c);
    assert_pattern_written(&srv, &qemu_io_pattern(&srv, &dir));
}

/// A plain client gets nothing from a server that requires TLS.
#[test]
fn plain_nbdinfo_is_refused() {
    let nbdinfo = tool("nbdinfo", "libnbd-bin");
    let c = cluster("c1");
    let srv = Server::start(NbdTls::Require(c.server.clone().into()));
    let uri = format!("nbd://127.0.0.1:{}/{EXPORT}", srv.port());
    let out = run(&nbdinfo, &[&uri]);
    assert!(!out.status.success(), "served without TLS: {}", show(&out));
    assert!(!String::from_utf8_lossy(&out.stdout).contains(&SIZE.to_string()));
}

/// A client that trusts the cluster's CA but holds a certificate of
/// another CA is refused in the TLS handshake.
#[test]
fn nbdinfo_with_a_certificate_of_another_ca_is_refused() {
    let nbdinfo = tool("nbdinfo", "libnbd-bin");
    let (c, other) = (cluster("c1"), cluster("c2"));
    let srv = Server::start(NbdTls::Require(c.server.clone().into()));
    let tmp = tempfile::tempdir().expect("temp dir");
    let dir = client_dir(tmp.path(), "foreign", &c, &other);
    let out = run(&nbdinfo, &[&nbds_uri(&srv, &dir)]);
    assert!(!out.status.success(), "served a stranger: {}", show(&out));
    // The server's alert, not the client's own refusal of the server.
    let stderr = String::from_utf8_lossy(&out.stderr).to_lowercase();
    assert!(stderr.contains("alert"), "{}", show(&out));
    assert!(!String::from_utf8_lossy(&out.stdout).contains(&SIZE.to_string()));
}

// ---- TLS-PSK: pre-shared keys instead of certificates ----

/// The user psktool makes a key for.
const PSK_USER: &str = "alice";

/// A key folder as qemu's `tls-creds-psk,dir=DIR` reads it: `DIR/keys.psk`,
/// made by GnuTLS's own `psktool` (so the format is the clients'), with
/// one key, for `user`.
fn psk_dir(root: &Path, name: &str, user: &str) -> PathBuf {
    let psktool = tool("psktool", "gnutls-bin");
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).expect("key folder");
    let file = dir.join("keys.psk");
    let out = run(&psktool, &["-u", user, "-p", file.to_str().expect("path")]);
    assert!(out.status.success(), "psktool failed: {}", show(&out));
    dir
}

/// A server requiring TLS-PSK with the keys of `dir`.
fn psk_server(dir: &Path) -> Server {
    let keys = PskKeys::load(dir.join("keys.psk")).expect("the key file psktool made");
    Server::start(NbdTls::Require(
        PskConfig::new(keys).expect("PSK config").into(),
    ))
}

fn nbds_psk_uri(srv: &Server, user: &str, dir: &Path) -> String {
    format!(
        "nbds://{user}@127.0.0.1:{}/{EXPORT}?tls-psk-file={}",
        srv.port(),
        dir.join("keys.psk").display()
    )
}

/// qemu's `--object` and `--image-opts` for the export over TLS-PSK as
/// `user` with the keys of `dir`.
fn qemu_psk(srv: &Server, user: &str, dir: &Path) -> [String; 3] {
    [
        "--object".to_string(),
        format!(
            "tls-creds-psk,id=tls0,endpoint=client,dir={},username={user}",
            dir.display()
        ),
        format!(
            "driver=nbd,server.type=inet,server.host=127.0.0.1,server.port={},\
             export={EXPORT},tls-creds=tls0",
            srv.port()
        ),
    ]
}

/// The client's TLS failed: not served, and not a size on stdout.
fn assert_not_served(out: &Output, what: &str) {
    assert!(!out.status.success(), "{what} was served: {}", show(out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains(&SIZE.to_string()), "{what}: {}", show(out));
    assert!(!text.contains("virtual size"), "{what}: {}", show(out));
}

/// libnbd with a key file psktool made: the export's size.
#[test]
fn nbdinfo_over_tls_psk_shows_the_size() {
    let nbdinfo = tool("nbdinfo", "libnbd-bin");
    let tmp = tempfile::tempdir().expect("temp dir");
    let dir = psk_dir(tmp.path(), "keys", PSK_USER);
    let srv = psk_server(&dir);
    let out = run(&nbdinfo, &["--size", &nbds_psk_uri(&srv, PSK_USER, &dir)]);
    assert!(out.status.success(), "nbdinfo failed: {}", show(&out));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        SIZE.to_string()
    );
}

/// qemu-io with `tls-creds-psk` writes a pattern and reads it back (the
/// export holds it), and qemu-img info shows the size.
#[test]
fn qemu_over_tls_psk_writes_and_reads_back() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let dir = psk_dir(tmp.path(), "keys", PSK_USER);
    let srv = psk_server(&dir);
    let [object, creds, image] = qemu_psk(&srv, PSK_USER, &dir);
    let qemu_io = tool("qemu-io", "qemu-utils");
    let args = [
        object.as_str(),
        &creds,
        "--image-opts",
        "-c",
        "write -P 0x5a 0 64k",
        "-c",
        "read -P 0x5a 0 64k",
        &image,
    ];
    assert_pattern_written(&srv, &run(&qemu_io, &args));

    let qemu_img = tool("qemu-img", "qemu-utils");
    let out = run(
        &qemu_img,
        &["info", &object, &creds, "--image-opts", &image],
    );
    assert!(out.status.success(), "qemu-img info failed: {}", show(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(&format!("({SIZE} bytes)")), "{}", show(&out));
}

/// The right identity with another key: libnbd and qemu are refused in
/// the handshake.
#[test]
fn a_wrong_psk_key_is_refused() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let dir = psk_dir(tmp.path(), "keys", PSK_USER);
    let other = psk_dir(tmp.path(), "other", PSK_USER);
    let srv = psk_server(&dir);
    let nbdinfo = tool("nbdinfo", "libnbd-bin");
    let out = run(&nbdinfo, &[&nbds_psk_uri(&srv, PSK_USER, &other)]);
    assert_not_served(&out, "nbdinfo with a wrong key");
    let [object, creds, image] = qemu_psk(&srv, PSK_USER, &other);
    let qemu_img = tool("qemu-img", "qemu-utils");
    let out = run(
        &qemu_img,
        &["info", &object, &creds, "--image-opts", &image],
    );
    assert_not_served(&out, "qemu-img with a wrong key");
    // The right key still passes after the refusals.
    let out = run(&nbdinfo, &["--size", &nbds_psk_uri(&srv, PSK_USER, &dir)]);
    assert!(out.status.success(), "nbdinfo failed: {}", show(&out));
}

/// An identity the server has no key for is refused, whatever its key.
#[test]
fn an_unknown_psk_identity_is_refused() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let dir = psk_dir(tmp.path(), "keys", PSK_USER);
    let stranger = psk_dir(tmp.path(), "stranger", "mallory");
    let srv = psk_server(&dir);
    let nbdinfo = tool("nbdinfo", "libnbd-bin");
    let out = run(&nbdinfo, &[&nbds_psk_uri(&srv, "mallory", &stranger)]);
    assert_not_served(&out, "nbdinfo as an unknown identity");
    let [object, creds, image] = qemu_psk(&srv, "mallory", &stranger);
    let qemu_img = tool("qemu-img", "qemu-utils");
    let out = run(
        &qemu_img,
        &["info", &object, &creds, "--image-opts", &image],
    );
    assert_not_served(&out, "qemu-img as an unknown identity");
}

/// With TLS-PSK required, a plain client gets nothing, and neither does
/// a client that offers a certificate instead of a key.
#[test]
fn plain_and_x509_clients_are_refused_by_a_psk_server() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let dir = psk_dir(tmp.path(), "keys", PSK_USER);
    let srv = psk_server(&dir);
    let nbdinfo = tool("nbdinfo", "libnbd-bin");
    let plain = format!("nbd://127.0.0.1:{}/{EXPORT}", srv.port());
    assert_not_served(&run(&nbdinfo, &[&plain]), "plain nbdinfo");
    let c = cluster("c1");
    let certs = client_dir(tmp.path(), "x509", &c, &c);
    let out = run(&nbdinfo, &[&nbds_uri(&srv, &certs)]);
    assert_not_served(&out, "nbdinfo with a certificate");
}

/// `allow` with TLS-PSK: plain clients are served, and so are PSK
/// clients.
#[test]
fn allow_with_psk_serves_plain_and_psk_clients() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let dir = psk_dir(tmp.path(), "keys", PSK_USER);
    let keys = PskKeys::load(dir.join("keys.psk")).expect("key file");
    let srv = Server::start(NbdTls::Allow(PskConfig::new(keys).expect("config").into()));
    let nbdinfo = tool("nbdinfo", "libnbd-bin");
    let plain = format!("nbd://127.0.0.1:{}/{EXPORT}", srv.port());
    for uri in [plain, nbds_psk_uri(&srv, PSK_USER, &dir)] {
        let out = run(&nbdinfo, &["--size", &uri]);
        assert!(out.status.success(), "{uri}: {}", show(&out));
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            SIZE.to_string()
        );
    }
}

/// Many requests in flight both ways over TLS-PSK: nbdcopy writes the
/// whole export in 4 KiB requests (64 at once) and reads it back in
/// 4 MiB ones; every byte arrives as sent.
#[test]
fn nbdcopy_over_tls_psk_moves_every_byte() {
    let nbdcopy = tool("nbdcopy", "libnbd-bin");
    let tmp = tempfile::tempdir().expect("temp dir");
    let dir = psk_dir(tmp.path(), "keys", PSK_USER);
    let srv = psk_server(&dir);
    let uri = nbds_psk_uri(&srv, PSK_USER, &dir);
    let data: Vec<u8> = (0..SIZE).map(|_| rand::random::<u8>()).collect();
    let src = tmp.path().join("src.raw");
    std::fs::write(&src, &data).expect("source file");
    let src = src.to_str().expect("path");
    let args = [
        "--request-size=4096",
        "--requests=64",
        "--connections=2",
        src,
        &uri,
    ];
    let out = run(&nbdcopy, &args);
    assert!(
        out.status.success(),
        "nbdcopy to the export: {}",
        show(&out)
    );
    assert!(srv.disk.snapshot() == data, "the export holds other data");
    let back = tmp.path().join("back.raw");
    let back_s = back.to_str().expect("path");
    let args = ["--request-size=4194304", "--requests=4", &uri, back_s];
    let out = run(&nbdcopy, &args);
    assert!(
        out.status.success(),
        "nbdcopy from the export: {}",
        show(&out)
    );
    assert!(
        std::fs::read(&back).expect("copy") == data,
        "read back other data"
    );
}
