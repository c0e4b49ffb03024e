"""toolchain/pipeline.py: the one place that maps a spec's target to its path's stages and server."""

import pytest

from toolchain import pipeline
from toolchain.checkpoint.stage import run_convert
from toolchain.errors import ToolchainError
from toolchain.llmapi.repo import run_model_repo_llmapi
from toolchain.llmapi.stage import run_convert_llmapi
from toolchain.spec import DeploymentSpec
from toolchain.triton.launch import TritonLaunch
from toolchain.triton.repo import run_model_repo
from toolchain.triton.server import TritonServer
from toolchain.workspace import Workspace


@pytest.mark.parametrize("target, convert, model_repo", [
    ("cpu", run_convert, run_model_repo), ("trtllm", run_convert, run_model_repo),
    ("llmapi", run_convert_llmapi, run_model_repo_llmapi), ("llmapi-cpu", run_convert_llmapi, run_model_repo_llmapi)])
def test_each_path_gets_its_own_stages(target, convert, model_repo):
    spec = DeploymentSpec(target=target)
    assert pipeline.convert_for(spec) is convert
    assert pipeline.model_repo_for(spec) is model_repo


def test_the_engine_stages_refuse_an_llmapi_spec_instead_of_switching(tmp_path):
    spec = DeploymentSpec(target="llmapi-cpu")
    ws = Workspace(tmp_path)
    with pytest.raises(ToolchainError, match="target llmapi-cpu has no TensorRT-LLM checkpoint"):
        run_convert(spec, ws)
    with pytest.raises(ToolchainError, match="target llmapi-cpu takes the LLM-API path"):
        run_model_repo(spec, ws)
    assert not any(tmp_path.iterdir())  # refused before writing anything


@pytest.mark.parametrize("target, serving, kind", [
    ("cpu", {}, TritonServer), ("cpu", {"launch": "mpirun"}, TritonLaunch), ("llmapi-cpu", {}, TritonServer)])
def test_serve_and_deploy_start_the_server_server_for_picks(tmp_path, target, serving, kind):
    spec = DeploymentSpec(target=target, serving=serving)
    ws = Workspace(tmp_path)
    server = pipeline.server_for(spec, ws)
    assert type(server) is kind
    if isinstance(server, TritonLaunch):  # mpirun's ranks always log, next to the repository
        assert server.log_path == pipeline.server_log(spec, ws)
    else:
        assert server.log_path is None  # deploy's single server, as before
        assert pipeline.server_for(spec, ws, log_path=tmp_path / "s.log").log_path == tmp_path / "s.log"
