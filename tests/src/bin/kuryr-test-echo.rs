//! A tiny echo server and client for the Service and host port tests, run inside network
//! namespaces with `nsenter`: the server answers every TCP connection and every UDP datagram
//! with its name and the address the request came from, so a test sees both who answered and
//! whether the client's address was kept or masqueraded on the way.
//!
//! ```text
//! kuryr-test-echo serve NAME PORT        # TCP, UDP (and SCTP where the kernel has it) on [::]:PORT
//!                                        # (IPv4 too), until killed
//! kuryr-test-echo tcp ADDR PORT [SECS]   # prints the answer; exit 1 with the reason otherwise
//! kuryr-test-echo udp ADDR PORT [SECS]
//! kuryr-test-echo sctp ADDR PORT [SECS]
//! kuryr-test-echo connect ADDR PORT N    # N TCP connections in a row, timed
//! ```
//!
//! Answers are one line, `NAME PEER-ADDRESS`. Failures print `refused`, `timeout`, `unreachable`,
//! `prohibited` (an ICMPv6 "administratively prohibited", which the kernel reports as EACCES; its
//! IPv4 counterpart is reported as unreachable) or the OS error to stderr.
//!
//! `connect` opens N TCP connections one after the other (each to its answer and close) and prints
//! one line per connection, `CONNECT-µs ANSWER-µs`: the time for `connect` to return (the SYN
//! out, the SYN-ACK back: the new connection judged by every rule it meets) and to the server's
//! answer. The first failure ends it (exit 1, the reason on stderr).
#![allow(clippy::print_stdout)] // a command whose output is the point

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::process::ExitCode;
use std::time::Duration;

fn peer(addr: SocketAddr) -> IpAddr {
    match addr.ip() {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    }
}

fn serve(name: &str, port: u16) -> std::io::Result<()> {
    let any = SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port);
    let tcp = TcpListener::bind(any)?;
    let udp = UdpSocket::bind(any)?;
    let udp_name = name.to_string();
    std::thread::spawn(move || {
        let mut buf = [0u8; 1500];
        loop {
            if let Ok((_, from)) = udp.recv_from(&mut buf) {
                let _ = udp.send_to(format!("{udp_name} {}\n", peer(from)).as_bytes(), from);
            }
        }
    });
    // SCTP (one-to-one sockets, answered like TCP) where the kernel has it; without it the
    // socket cannot be made and only TCP and UDP are served.
    if let Ok(sctp) = sctp_listener(any) {
        let sctp_name = name.to_string();
        std::thread::spawn(move || {
            while let Ok((mut conn, from)) = sctp.accept() {
                if let Some(from) = from.as_socket() {
                    let _ = conn.write_all(format!("{sctp_name} {}\n", peer(from)).as_bytes());
                }
            }
        });
    }
    for conn in tcp.incoming() {
        let Ok(mut conn) = conn else { continue };
        if let Ok(from) = conn.peer_addr() {
            let _ = conn.write_all(format!("{name} {}\n", peer(from)).as_bytes());
        }
    }
    Ok(())
}

const IPPROTO_SCTP: i32 = 132;

fn sctp_socket(addr: &SocketAddr) -> std::io::Result<socket2::Socket> {
    let domain = if addr.is_ipv4() { socket2::Domain::IPV4 } else { socket2::Domain::IPV6 };
    socket2::Socket::new(domain, socket2::Type::STREAM, Some(socket2::Protocol::from(IPPROTO_SCTP)))
}

fn sctp_listener(any: SocketAddr) -> std::io::Result<socket2::Socket> {
    let s = sctp_socket(&any)?;
    s.set_only_v6(false)?;
    s.set_reuse_address(true)?;
    s.bind(&any.into())?;
    s.listen(128)?;
    Ok(s)
}

fn ask_sctp(to: SocketAddr, timeout: Duration) -> std::io::Result<String> {
    let s = sctp_socket(&to)?;
    s.connect_timeout(&to.into(), timeout)?;
    s.set_read_timeout(Some(timeout))?;
    read_answer(s)
}

/// Everything the server sent until it closed; an error when that was nothing.
fn read_answer(mut s: impl Read) -> std::io::Result<String> {
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    if out.trim().is_empty() {
        return Err(std::io::Error::new(ErrorKind::UnexpectedEof, "closed without an answer"));
    }
    Ok(out)
}

fn reason(e: &std::io::Error) -> String {
    match e.kind() {
        ErrorKind::ConnectionRefused | ErrorKind::ConnectionReset => "refused".into(),
        ErrorKind::TimedOut | ErrorKind::WouldBlock => "timeout".into(),
        ErrorKind::HostUnreachable | ErrorKind::NetworkUnreachable => "unreachable".into(),
        ErrorKind::PermissionDenied => "prohibited".into(),
        _ => e.to_string(),
    }
}

fn ask_tcp(to: SocketAddr, timeout: Duration) -> std::io::Result<String> {
    let s = TcpStream::connect_timeout(&to, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    read_answer(s)
}

fn ask_udp(to: SocketAddr, timeout: Duration) -> std::io::Result<String> {
    let local: IpAddr = if to.is_ipv4() { Ipv4Addr::UNSPECIFIED.into() } else { Ipv6Addr::UNSPECIFIED.into() };
    let s = UdpSocket::bind(SocketAddr::new(local, 0))?;
    // Connected: an ICMP port unreachable comes back as ECONNREFUSED on the next receive.
    s.connect(to)?;
    s.set_read_timeout(Some(timeout))?;
    s.send(b"hello\n")?;
    let mut buf = [0u8; 1500];
    let n = s.recv(&mut buf)?;
    Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
}

/// `n` timed TCP connections to `to`.
fn connect_timed(to: SocketAddr, n: usize) -> std::io::Result<()> {
    let timeout = Duration::from_secs(2);
    let mut out = String::with_capacity(n * 16);
    for _ in 0..n {
        let t = std::time::Instant::now();
        let mut s = TcpStream::connect_timeout(&to, timeout)?;
        let connected = t.elapsed();
        s.set_read_timeout(Some(timeout))?;
        let mut answer = String::new();
        s.read_to_string(&mut answer)?;
        if answer.trim().is_empty() {
            return Err(std::io::Error::new(ErrorKind::UnexpectedEof, "closed without an answer"));
        }
        out.push_str(&format!("{} {}\n", connected.as_micros(), t.elapsed().as_micros()));
    }
    print!("{out}");
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let port = |s: Option<&String>| s.and_then(|p| p.parse::<u16>().ok());
    match args.first().map(String::as_str) {
        Some("serve") => {
            let (Some(name), Some(p)) = (args.get(1), port(args.get(2))) else {
                eprintln!("usage: kuryr-test-echo serve NAME PORT");
                return ExitCode::from(2);
            };
            if let Err(e) = serve(name, p) {
                eprintln!("serve: {e}");
                return ExitCode::FAILURE;
            }
            ExitCode::SUCCESS
        }
        Some(proto @ ("tcp" | "udp" | "sctp")) => {
            let (Some(addr), Some(p)) = (args.get(1).and_then(|a| a.parse::<IpAddr>().ok()), port(args.get(2))) else {
                eprintln!("usage: kuryr-test-echo tcp|udp|sctp ADDR PORT [SECS]");
                return ExitCode::from(2);
            };
            let secs = args.get(3).and_then(|s| s.parse::<f64>().ok()).unwrap_or(2.0);
            let timeout = Duration::from_secs_f64(secs);
            let to = SocketAddr::new(addr, p);
            let res = match proto {
                "tcp" => ask_tcp(to, timeout),
                "sctp" => ask_sctp(to, timeout),
                _ => ask_udp(to, timeout),
            };
            match res {
                Ok(answer) => {
                    print!("{answer}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("{}", reason(&e));
                    ExitCode::FAILURE
                }
            }
        }
        Some("connect") => {
            let addr = args.get(1).and_then(|a| a.parse::<IpAddr>().ok());
            let n = args.get(3).and_then(|s| s.parse::<usize>().ok());
            let (Some(addr), Some(p), Some(n)) = (addr, port(args.get(2)), n) else {
                eprintln!("usage: kuryr-test-echo connect ADDR PORT N");
                return ExitCode::from(2);
            };
            match connect_timed(SocketAddr::new(addr, p), n) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("{}", reason(&e));
                    ExitCode::FAILURE
                }
            }
        }
        _ => {
            eprintln!("usage: kuryr-test-echo serve NAME PORT | tcp|udp|sctp ADDR PORT [SECS] | connect ADDR PORT N");
            ExitCode::from(2)
        }
    }
}
