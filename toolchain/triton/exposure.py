"""What tritonserver exposes beyond this machine, and the key that guards it.

tritonserver serves its administrative APIs (model repository control, shared
memory registration, statistics, tracing and log settings) to anyone who
reaches the HTTP or gRPC port. On loopback that is this machine's users; on any
other address it is the network. So when `serving.host` is not a loopback
address (or `serving.admin_key_file` asks for it), those APIs are put behind a
key with Triton's restricted-API options (`tritonserver --help`, 2.51 in the
nvidia-pytriton wheel; docs/customization_guide/inference_protocols.md,
"Limit Endpoint Access"):

    --http-restricted-api=<apis>:<header>=<value>       HTTP: header <header>
    --grpc-restricted-protocol=<apis>:<header>=<value>  gRPC: metadata triton-grpc-protocol-<header>

Left open: health, metadata, inference, and model-config, which every client
(the bench, tritonclient, perf_analyzer) reads before its first inference and
which changes nothing. The metrics endpoint binds to loopback unless
`serving.metrics_host` says otherwise.

tritonserver takes the key only on its command line (no file or environment
input), so the key is in its argv on the serving host. Every line this module
renders for printing refers to the key instead (`"$VAR"`, `"$(cat FILE)"`, or
Kubernetes' `$(VAR)` from a Secret) and never holds the secret itself.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shlex
from pathlib import Path

from toolchain.errors import ToolchainError

# Every group Triton can restrict except the ones a client needs to infer.
RESTRICTED_APIS = ("model-repository", "shared-memory", "statistics", "trace", "logging")
HEADER = "admin-key"  # HTTP header name; gRPC metadata is GRPC_HEADER
GRPC_HEADER = f"triton-grpc-protocol-{HEADER}"
# Stands for the key in command lines built for printing. Only characters shlex
# leaves unquoted, so it survives shlex.join and can be swapped for a shell
# reference afterwards.
PLACEHOLDER = "@TOOLCHAIN_ADMIN_KEY@"
# Base64, hex and URL-safe tokens: safe as an HTTP header value, in Triton's
# `<apis>:<header>=<value>` option and in a shell word.
_KEY_CHARS = re.compile(r"^[A-Za-z0-9._~+/=-]+$")
MIN_KEY_LEN = 16
_MAKE_ONE = "e.g. `openssl rand -hex 32`"


def is_loopback(host: str) -> bool:
    """True for addresses only this machine reaches (127.0.0.0/8, ::1, localhost).
    Wildcards (0.0.0.0, ::) and any other name count as exposed."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def restricted(serving) -> bool:
    """Whether the administrative APIs need the key."""
    return not is_loopback(serving.host) or serving.admin_key_file is not None


def metrics_host(serving) -> str:
    """Where the metrics endpoint binds: the spec's choice, else `host` when that is
    loopback, else 127.0.0.1 (tritonserver's own default is the HTTP address)."""
    if serving.metrics_host:
        return serving.metrics_host
    return serving.host if is_loopback(serving.host) else "127.0.0.1"


def metrics_private(serving) -> bool:
    """Whether the metrics endpoint stays on loopback while the other endpoints are exposed: a pod or Service
    then declares no metrics port (nothing outside the pod reaches it)."""
    return is_loopback(metrics_host(serving)) and not is_loopback(serving.host)


def published_on(serving, kind: str) -> str:
    """The host address a container publishes its `kind` port on ("metrics", or "http", "grpc", "openai"): where
    the spec binds that endpoint on a host, so a container exposes what the same spec exposes without one. Inside
    the container the server binds every interface: a port published to a server bound to the container's own
    loopback reaches nothing."""
    return metrics_host(serving) if kind == "metrics" else serving.host


def key_source(serving) -> str:
    return f"file {serving.admin_key_file}" if serving.admin_key_file is not None else f"${serving.admin_key_env}"


def read_admin_key(serving, environ: dict[str, str] | None = None) -> str:
    """The key from `admin_key_file`, else from the `admin_key_env` variable; a
    one-line ToolchainError when it is missing, empty or unusable."""
    path = serving.admin_key_file
    if path is not None:
        try:
            # Trailing newlines only, as the shell's "$(cat FILE)" in the printed lines drops them.
            key = Path(path).read_text().rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as err:
            raise ToolchainError(f"serving.admin_key_file {path} cannot be read ({err.__class__.__name__})",
                                 f"write the key for Triton's administrative APIs there, {_MAKE_ONE}") from None
        where, why = f"serving.admin_key_file {path}", "is empty"
    else:
        env = os.environ if environ is None else environ
        key = env.get(serving.admin_key_env, "")
        where, why = f"${serving.admin_key_env}", ("is empty" if serving.admin_key_env in env else "is not set")
    if not key:
        reason = f"serving.host {serving.host} is not loopback" if not is_loopback(serving.host) else "asked for"
        raise ToolchainError(f"Triton's administrative APIs need a key ({reason}), but {where} {why}",
                             f"export {serving.admin_key_env}=<key> or set serving.admin_key_file, {_MAKE_ONE}; "
                             "or bind serving.host to 127.0.0.1")
    if not _KEY_CHARS.match(key) or len(key) < MIN_KEY_LEN:
        raise ToolchainError(f"the admin key in {where} must be at least {MIN_KEY_LEN} characters of "
                             "A-Z a-z 0-9 . _ ~ + / = -", _MAKE_ONE)
    return key


def restriction_args(key: str) -> list[str]:
    """The tritonserver options putting RESTRICTED_APIS behind `key` on HTTP and gRPC."""
    group = f"{','.join(RESTRICTED_APIS)}:{HEADER}={key}"
    return [f"--http-restricted-api={group}", f"--grpc-restricted-protocol={group}"]


def shell_reference(serving, file_path: str | None = None) -> str:
    """A shell word that expands to the key where the line runs: the file's content or
    the variable's value (`file_path` overrides where the file is, e.g. in a container)."""
    if serving.admin_key_file is not None:
        return f'"$(cat {shlex.quote(file_path or str(serving.admin_key_file))})"'
    # ${VAR:?...}: the shell stops with a message rather than start a server keyed with "".
    return f'"${{{serving.admin_key_env}:?set {serving.admin_key_env} to the admin key}}"'


def warning(serving) -> str | None:
    """The one line serve and deploy print when the APIs are restricted."""
    if not restricted(serving):
        return None
    return (f"warning: tritonserver listens on {serving.host}; its administrative APIs "
            f"({', '.join(RESTRICTED_APIS)}) need header '{HEADER}' (gRPC '{GRPC_HEADER}') with the key from "
            f"{key_source(serving)}; metrics on {metrics_host(serving)}")
