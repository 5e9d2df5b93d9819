"""The command line of ``ems-server``: its flags, its ``--config`` file, and the commands.

Commands::

    ems-server [serve] [--dir DIR] [--capacity 4G] [--disk-dir D --disk-capacity 10G]
                       [--remote redis://H:P | redis+cluster://H:P] [--credentials FILE]
                       [--tcp HOST:PORT] [--socket-mode 0600] [--idle-exit SECONDS] [--detach]
                       [--ready-fd FD] [--metrics-port [HOST:]PORT]
    ems-server stats [--dir DIR | --server ADDR] [--json]
    ems-server stop  [--dir DIR]

``serve`` flags may also come from a TOML file (``--config PATH``, keys as the flags
without ``--``); the command line's own flags win.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import tomllib
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Union

from datadist.engine.version import __version__

from .daemon import DEFAULT_DIR, AlreadyRunning, Daemon, ServerConfig
from .tiers.disk import parse_size

__all__ = ["main", "EXIT_ALREADY_RUNNING"]

#: Exit status when another daemon already serves the directory.
EXIT_ALREADY_RUNNING = 3

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class _Parsers(NamedTuple):
    """The command line's parser and the one of ``serve`` (whose flags a config file sets)."""

    main: argparse.ArgumentParser
    serve: argparse.ArgumentParser


def _parsers() -> _Parsers:
    p = argparse.ArgumentParser(prog="ems-server", description="EMS context-caching pool daemon")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="cmd")
    serve = sub.add_parser("serve", help="run the daemon (the default command)")
    _serve_args(serve)
    stats = sub.add_parser("stats", help="print a running daemon's statistics")
    stats.add_argument("--dir", default=None, help=f"socket directory (default {DEFAULT_DIR})")
    stats.add_argument("--server", default=None, help="address: DIR, unix://PATH or tcp://HOST:PORT")
    stats.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    stats.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the daemon")
    stop = sub.add_parser("stop", help="ask a running daemon to shut down (spilling to disk)")
    stop.add_argument("--dir", default=DEFAULT_DIR)
    stop.add_argument("--timeout", type=float, default=3.0)
    return _Parsers(p, serve)


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="PATH", default=None,
                   help="TOML file of these settings (keys as the flags without '--', e.g. capacity = \"8G\"); "
                        "flags given on the command line override it")
    p.add_argument("--dir", default=DEFAULT_DIR, help=f"socket directory (default {DEFAULT_DIR})")
    p.add_argument("--capacity", default="1G", type=_size("--capacity"), help="shared-memory capacity, e.g. 512M, 8G")
    p.add_argument("--disk-dir", default=None, help="disk tier directory (evicted values spill there)")
    p.add_argument("--disk-capacity", default="10G", type=_size("--disk-capacity"), help="disk tier capacity")
    p.add_argument("--remote", default=None, help="remote tier: redis://H:P[/db] or redis+cluster://H:P")
    p.add_argument("--credentials", default=None, help="file of 'access_id: access_key' lines")
    p.add_argument("--tcp", default=None, help="also listen on HOST:PORT (port 0: any free port)")
    p.add_argument("--secret-file", default=None,
                   help="file holding the pool secret: clients (EmsConfig.secret or EMS_SECRET) and the daemon "
                        "prove to each other that they hold it before anything else")
    for role, what in (("cert", "this daemon's certificate"), ("key", "its private key (unencrypted)"),
                       ("ca", "the CA that signed the clients' certificates")):
        p.add_argument(f"--tls-{role}-file", default=None,
                       help=f"TLS on the --tcp port (all three flags, else env EMS_TLS_{role.upper()}_FILE and "
                            f"the other two): {what}")
    p.add_argument("--idle-exit", type=float, default=0.0,
                   help="exit after this many seconds without clients (0: never)")
    p.add_argument("--socket-mode", default="0600", type=_octal,
                   help="permissions of the unix socket (default 0600: the daemon's user only; "
                        "0660 for its group, 0666 for everyone, best with --credentials)")
    p.add_argument("--max-connections", type=_positive(int), default=1024,
                   help="client connections open at once (default 1024; more are refused with an error)")
    p.add_argument("--idle-timeout", type=_positive(float, zero=True), default=600.0,
                   help="seconds before an idle client connection is closed (default 600; 0: never)")
    p.add_argument("--read-timeout", type=_positive(float), default=30.0,
                   help="seconds within which a started request must arrive whole (default 30)")
    p.add_argument("--drain-timeout", type=_positive(float, zero=True), default=10.0,
                   help="seconds a stopping daemon (SIGTERM, SIGINT, stop) lets requests in flight finish "
                        "before it cuts them")
    p.add_argument("--reserve-timeout", type=_positive(float), default=120.0,
                   help="seconds after which a value reserved but not committed is taken back when "
                        "memory is short (default 120)")
    p.add_argument("--no-spill-on-exit", action="store_true",
                   help="do not spill memory to the disk tier at shutdown")
    p.add_argument("--detach", action="store_true", help="fork into the background (new session)")
    p.add_argument("--ready-fd", type=int, default=None,
                   help="write 'READY <pid> <tcp address>' to this fd once serving, then close it")
    p.add_argument("--metrics-port", default=None, metavar="[HOST:]PORT",
                   help="serve Prometheus metrics at /metrics and readiness at /healthz on this port "
                        "(host 0.0.0.0 unless given; needs prometheus_client; docs/operations.md)")
    p.add_argument("--log-file", default=None, help="log here instead of stderr")
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=_LOG_LEVELS,
                   help=f"one of {', '.join(_LOG_LEVELS)} (default INFO)")


def _size(flag: str) -> Callable[[str], int]:
    """An argparse type: a size like 512M or 8G, in bytes."""
    def convert(text: str) -> int:
        try:
            return parse_size(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} expects a size like 512M, 8G or 1048576, got {text!r}") \
                from None
    return convert


def _positive(kind: Union[type[int], type[float]], zero: bool = False) -> Callable[[str], float]:
    """An argparse type: a number > 0 (or >= 0 with ``zero``) of ``kind``."""
    def convert(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if value < 0 or (value == 0 and not zero):
            raise argparse.ArgumentTypeError(f"must be {'>= 0' if zero else '> 0'}, got {text!r}")
        return value
    return convert


def _octal(text: str) -> int:
    try:
        mode = int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--socket-mode must be octal like 0660, got {text!r}") from None
    if not 0 <= mode <= 0o777:
        raise argparse.ArgumentTypeError(f"--socket-mode must be within 0000-0777, got {text!r}")
    return mode


def main(argv: Optional[List[str]] = None) -> int:
    """``ems-server [serve|stats|stop] ...``; the process's exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
        argv.insert(0, "serve")
    parsers = _parsers()
    if argv and argv[0] == "serve":
        argv = ["serve", *_config_flags(parsers.serve, argv[1:]), *argv[1:]]
    args = parsers.main.parse_args(argv)
    if args.cmd == "stats":
        return _stats(args)
    if args.cmd == "stop":
        return _stop(args)
    return _serve(args)


# -- the --config file ---------------------------------------------------------------------
def _config_flags(serve: argparse.ArgumentParser, argv: List[str]) -> List[str]:
    """The flags a ``--config`` TOML file sets, to go before the command line's own (which
    then win).  An unreadable file, bad TOML or an unknown key exits with code 2, naming it."""
    path = _config_path(argv)
    if path is None:
        return []
    table = _load_config(serve, path)
    actions = {a.dest: a for a in serve._actions if a.option_strings and a.dest not in ("help", "config")}
    flags: List[str] = []
    for key, value in table.items():
        action = actions.get(str(key).replace("-", "_"))
        if action is None:
            serve.error(f"--config {path}: unknown key {key!r} (keys: {', '.join(sorted(actions))})")
        flags += _config_flag(serve, path, action, key, value)
    return flags


def _config_path(argv: List[str]) -> Optional[str]:
    """The last ``--config PATH`` (or ``--config=PATH``) of ``argv``, if any."""
    path = None
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
    return path


def _load_config(serve: argparse.ArgumentParser, path: str) -> Dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        serve.error(f"--config {path}: {exc.strerror}")
    except tomllib.TOMLDecodeError as exc:
        serve.error(f"--config {path}: not valid TOML ({exc})")


def _config_flag(serve: argparse.ArgumentParser, path: str, action: argparse.Action, key: str,
                 value: object) -> List[str]:
    """The command-line words of one config entry (none for a switch set to false)."""
    flag = action.option_strings[-1]
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            serve.error(f"--config {path}: {key} must be true or false, got {value!r}")
        return [flag] if value else []
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return [flag, str(value)]
    serve.error(f"--config {path}: {key} must be a string or a number, got {value!r}")


# -- the commands ---------------------------------------------------------------------------
def _serve(args: argparse.Namespace) -> int:
    cfg = _server_config(args)
    if args.detach:
        if _detach():
            return 0
        if args.log_file is None:
            args.log_file = os.path.join(args.dir, "ems-server.log")
    _setup_logging(args.log_file, args.log_level)
    try:
        daemon = Daemon(cfg)
    except (ValueError, OSError) as exc:  # a credentials or secret file that cannot be used
        _ready(args.ready_fd, f"FAILED {exc}")
        print(f"ems-server: error: {exc}", file=sys.stderr)
        return 2
    status = _start(daemon, args.ready_fd)
    if status is not None:
        return status
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: daemon.stop())
    _ready(args.ready_fd, f"READY {os.getpid()} {daemon.tcp_address or '-'}")
    daemon.serve_forever()
    return 0


def _server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        directory=args.dir, capacity=args.capacity, disk_dir=args.disk_dir,
        disk_capacity=args.disk_capacity, remote=args.remote,
        credentials=args.credentials, tcp=args.tcp, idle_exit=args.idle_exit,
        spill_on_exit=not args.no_spill_on_exit, socket_mode=args.socket_mode,
        max_connections=args.max_connections, idle_timeout=args.idle_timeout, read_timeout=args.read_timeout,
        drain_timeout=args.drain_timeout, reserve_timeout=args.reserve_timeout,
        secret_file=args.secret_file,
        tls_files=(args.tls_cert_file, args.tls_key_file, args.tls_ca_file), metrics=args.metrics_port)


def _detach() -> bool:
    """Fork into the background; True in the caller, which returns at once (the daemon
    goes on in a grandchild, in a new session, with stdin and stdout on /dev/null)."""
    # Double fork: the caller reaps the short-lived middle process at once, and the
    # daemon (reparented to init) never lingers as its zombie.
    if os.fork() > 0:
        return True
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(devnull, fd)
    return False


def _setup_logging(log_file: Optional[str], level: str) -> None:
    handlers: Optional[List[logging.Handler]] = None
    if log_file:
        os.makedirs(os.path.dirname(os.path.abspath(log_file)), exist_ok=True)
        handlers = [logging.FileHandler(log_file)]
    logging.basicConfig(level=getattr(logging, level),
                        format="%(asctime)s ems-server[%(process)d] %(levelname)s %(message)s",
                        handlers=handlers)


def _start(daemon: Daemon, ready_fd: Optional[int]) -> Optional[int]:
    """Start ``daemon``; None once it serves, else the exit status (told to ``ready_fd``)."""
    try:
        daemon.start()
    except AlreadyRunning as exc:
        logging.getLogger("ems.server").warning("%s", exc)
        _ready(ready_fd, f"RUNNING {exc}")
        return EXIT_ALREADY_RUNNING
    except (ValueError, OSError, ImportError) as exc:  # a bad --remote, --tcp or directory: one line, no traceback
        _ready(ready_fd, f"FAILED {type(exc).__name__}: {exc}")
        daemon.close()
        print(f"ems-server: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        _ready(ready_fd, f"FAILED {type(exc).__name__}: {exc}")
        daemon.close()
        raise
    return None


def _ready(fd: Optional[int], line: str) -> None:
    if fd is None:
        return
    try:
        os.write(fd, (line + "\n").encode())
        os.close(fd)
    except OSError:
        pass


def _stats(args: argparse.Namespace) -> int:
    from datadist.engine.tls import from_settings as tls_from_settings

    from ..client.conn import probe  # the client side of the protocol
    from ..config import ENV_TLS_FILES

    address = args.server or args.dir or DEFAULT_DIR
    try:
        stats = probe(address, "stats", timeout_s=args.timeout,
                      tls=tls_from_settings([], ENV_TLS_FILES) if address.startswith("tcp://") else None)
    except Exception as exc:
        print(f"ems-server stats: no daemon answers at {address}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(stats, sort_keys=True))
        return 0
    for key in sorted(stats):
        value = stats[key]
        if isinstance(value, dict):
            value = json.dumps(value, sort_keys=True)
        print(f"{key:>14}  {value}")
    return 0


def _stop(args: argparse.Namespace) -> int:
    from ..client.conn import probe

    try:
        probe(args.dir, "shutdown", timeout_s=args.timeout)
    except Exception as exc:
        print(f"ems-server stop: no daemon answers at {args.dir}: {exc}", file=sys.stderr)
        return 1
    return 0
