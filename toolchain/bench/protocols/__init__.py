"""Wire protocols: one transport per protocol, each turning one prompt into a request and stamping every
response as it arrives. What a transport is (its methods and its `Reply`) is written down in transport.py.
"""

from __future__ import annotations

from toolchain.bench.protocols.openai import OpenAI

PROTOCOLS = ("triton-grpc", "triton-http", "openai-completions", "openai-chat")


def make_transport(protocol: str, **kwargs):
    if protocol == "triton-grpc":
        from toolchain.bench.protocols.triton_grpc import TritonGrpc

        return TritonGrpc(**kwargs)
    if protocol == "triton-http":
        from toolchain.bench.protocols.triton_http import TritonHttp

        return TritonHttp(**kwargs)
    if protocol in ("openai-completions", "openai-chat"):
        return OpenAI(chat=protocol == "openai-chat", **kwargs)
    raise ValueError(f"unknown protocol {protocol!r}")
