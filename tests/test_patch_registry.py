"""The patch registry: replacement, stacked wrappers, aliases, idempotence, removal, versions;
and the layering rule of the patches."""

import ast
import json
import re
import sys
import threading
import time
import types
from datetime import timedelta
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from harness import free_port, launch, worker_script
from packaging.version import Version
from torch.distributed import distributed_c10d

from megatron_elaswave.device import resolve_device_backend
from megatron_elaswave.patches import (
    MINIMUM_TORCH,
    PatchRegistry,
    PatchTargetError,
    UnsupportedMegatronVersion,
    UnsupportedTorch,
    check_megatron_core_version,
    check_torch,
    compatibility_registry,
)
from megatron_elaswave.patches import distributed_work
from megatron_elaswave.patches.torch_version import missing_torch_api


@pytest.fixture
def target_modules():
    """``fake_lib.core`` with a function and a class, and ``fake_user`` importing the function."""
    core = types.ModuleType("fake_lib.core")
    package = types.ModuleType("fake_lib")
    package.core = core

    def compute(x):
        return x + 1

    class Engine:
        def run(self):
            return "run"

        @classmethod
        def create(cls):
            return "create"

    class FastEngine(Engine):
        pass

    core.compute, core.Engine, core.FastEngine = compute, Engine, FastEngine
    user = types.ModuleType("fake_user")
    user.compute = compute  # as `from fake_lib.core import compute` would bind it
    sys.modules.update({"fake_lib": package, "fake_lib.core": core, "fake_user": user})
    yield core, user
    for name in ("fake_lib", "fake_lib.core", "fake_user"):
        sys.modules.pop(name)


def add_ten(function):
    return lambda x: function(x) + 10


def double(function):
    return lambda x: function(x) * 2


def test_replacement_reaches_aliases_and_is_undone(target_modules):
    core, user = target_modules
    original = core.compute
    registry = PatchRegistry()
    registry.register("fake_lib.core.compute", lambda x: x - 1)
    registry.apply()
    assert core.compute(5) == 4 and user.compute(5) == 4
    registry.remove()
    assert core.compute is original and user.compute is original


def test_wrappers_stack_on_the_replacement_in_order(target_modules):
    core, _ = target_modules
    registry = PatchRegistry()
    registry.register_wrapper("fake_lib.core.compute", add_ten)
    registry.register_wrapper("fake_lib.core.compute", double)
    registry.register("fake_lib.core.compute", lambda x: x * 100)
    registry.apply()
    assert core.compute(1) == (1 * 100 + 10) * 2


def test_apply_is_idempotent_and_picks_up_new_patches(target_modules):
    core, user = target_modules
    registry = PatchRegistry()
    registry.register_wrapper("fake_lib.core.compute", add_ten)
    registry.apply()
    registry.apply()
    assert core.compute(0) == 11 and user.compute(0) == 11
    registry.register_wrapper("fake_lib.core.Engine.run", lambda run: lambda self: run(self) + "!")
    registry.apply()
    assert core.compute(0) == 11
    assert core.Engine().run() == "run!"


def test_methods_classmethods_and_inherited_attributes(target_modules):
    core, _ = target_modules
    registry = PatchRegistry()
    registry.register_wrapper("fake_lib.core.Engine.create",
                              lambda create: lambda cls: f"{create(cls)} {cls.__name__}")
    registry.register_wrapper("fake_lib.core.FastEngine.run", lambda run: lambda self: "fast")
    registry.apply()
    assert core.Engine.create() == "create Engine"
    assert core.FastEngine().run() == "fast" and core.Engine().run() == "run"
    registry.remove()
    assert core.Engine.create() == "create"
    assert "run" not in core.FastEngine.__dict__


def test_unknown_targets_are_reported(target_modules):
    registry = PatchRegistry()
    registry.register("fake_lib.core.missing", lambda: None)
    with pytest.raises(PatchTargetError, match="fake_lib.core.missing"):
        registry.apply()
    unimportable = PatchRegistry()
    unimportable.register("no_such_package_xyz.f", lambda: None)
    with pytest.raises(PatchTargetError, match="no importable module"):
        unimportable.apply()


def test_a_name_is_defined_only_where_its_module_lacks_it(target_modules):
    core, _ = target_modules
    registry = PatchRegistry()
    registry.define("fake_lib.core.forgotten", None)
    registry.define("fake_lib.core.compute", None)
    registry.apply()
    assert core.forgotten is None and core.compute(1) == 2
    registry.remove()
    assert not hasattr(core, "forgotten") and core.compute(1) == 2


def test_megatron_core_0_16_routes_without_transformer_engine_once_patched():
    """0.16.1's import fallback forgets ``te_general_gemm``; the router's gating linear needs
    the name (``None`` selects the plain matmul)."""
    from megatron.core.transformer.moe import moe_utils

    registry = compatibility_registry(resolve_device_backend("cpu"))
    registry.apply()
    try:
        weight = torch.randn(4, 8, requires_grad=True)
        tokens = torch.randn(3, 8)
        logits = moe_utils.router_gating_linear(tokens, weight, None, torch.float32)
        logits.sum().backward()
        assert torch.allclose(logits, tokens @ weight.t())
    finally:
        registry.remove()


def test_the_alltoall_dispatchers_split_sizes_reach_gloo_as_numpy_off_cuda():
    from megatron.core.transformer.moe import moe_utils

    registry = compatibility_registry(resolve_device_backend("cpu"))
    registry.apply()
    try:
        splits = moe_utils.maybe_move_tensor_to_cpu(torch.tensor([1, 2]), as_numpy=True)
        kept = moe_utils.maybe_move_tensor_to_cpu(torch.tensor([1, 2]))
        event = torch.cuda.Stream().record_event()
        event.synchronize()  # the dispatcher's wait for its device-to-host copies
    finally:
        registry.remove()
    assert splits.tolist() == [1, 2] and not torch.is_tensor(splits) and torch.is_tensor(kept)


def test_conflicting_replacements_are_refused(target_modules):
    registry = PatchRegistry()
    registry.register("fake_lib.core.compute", lambda x: x)
    with pytest.raises(ValueError, match="different replacement"):
        registry.register("fake_lib.core.compute", lambda x: -x)


def test_megatron_core_version_range():
    assert check_megatron_core_version() >= Version("0.16.1")
    with pytest.raises(UnsupportedMegatronVersion, match=r"found 0\.15\.0; run: pip install"):
        check_megatron_core_version(Version("0.15.0"))
    for supported in ("0.17.1", "0.18.2", "0.19.2"):
        assert check_megatron_core_version(Version(supported)) == Version(supported)
    with pytest.raises(UnsupportedMegatronVersion, match=r"supports megatron-core <0\.20,>=0\.16\.1, found 0\.20\.0"):
        check_megatron_core_version(Version("0.20.0"))


REPO = Path(__file__).resolve().parents[1]


def absolute_imports(source: str, package: str) -> list[str]:
    """The absolute imports of ``package`` or its modules in ``source``, at any depth (functions
    included), with their line numbers; ``importlib.import_module`` of a literal name counts."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant)):
            names = [node.args[0].value]
        else:
            continue
        found += [f"line {node.lineno}: {name}" for name in names
                  if name == package or str(name).startswith(package + ".")]
    return found


@pytest.mark.parametrize("path", sorted((REPO / "patches").glob("*.py")),
                         ids=lambda path: path.name)
def test_the_patches_import_nothing_from_the_runtime(path):
    """Layers go one way: scripts -> runtime -> patches -> Megatron-Core. What a patch needs of
    the runtime is handed to its ``register`` (``patches/interfaces.py``), never imported."""
    assert absolute_imports(path.read_text(), "megatron_elaswave") == []


def test_the_runtimes_training_does_not_import_the_megatron_lm_wing():
    """``megatron_elaswave.megatron_lm`` sits above ``training/``, which knows nothing of it."""
    for path in sorted((REPO / "megatron_elaswave" / "training").rglob("*.py")):
        assert absolute_imports(path.read_text(), "megatron_elaswave.megatron_lm") == [], path.name


def test_imports_are_found_wherever_they_are():
    source = """
from megatron_elaswave.device import DeviceBackend
from . import registry
import torch, megatron_elaswave.launch.store
import megatron_elaswave_other

def hook():
    from megatron_elaswave.training import arguments
    importlib.import_module("megatron_elaswave.runtime.dropout_rng")
"""
    assert absolute_imports(source, "megatron_elaswave") == [
        "line 2: megatron_elaswave.device", "line 4: megatron_elaswave.launch.store",
        "line 8: megatron_elaswave.training", "line 9: megatron_elaswave.runtime.dropout_rng"]


def test_the_installed_torch_has_every_api_used():
    assert missing_torch_api() is None
    check_torch()


def test_setup_requires_the_torch_the_check_names():
    setup_py = (Path(__file__).resolve().parents[1] / "setup.py").read_text()
    assert re.findall(r'^TORCH = "torch>=([0-9.]+)"$', setup_py, re.M) == [MINIMUM_TORCH]


def _refusal(api: str) -> str:
    return f"megatron-elaswave needs torch>={MINIMUM_TORCH}: torch {torch.__version__} has no {api}"


@pytest.mark.parametrize("owner, name, api", [
    (distributed_c10d, "GroupName", "torch.distributed.distributed_c10d.GroupName (new in torch 2.10)"),
    (dist.ProcessGroup, "set_timeout", "torch.distributed.ProcessGroup.set_timeout (new in torch 2.9)"),
    (dist.ProcessGroup, "abort", "torch.distributed.ProcessGroup.abort (new in torch 2.7)"),
    (dist.Work, "get_future", "torch.distributed.Work.get_future"),
    (dist, "get_process_group_ranks", "torch.distributed.get_process_group_ranks"),
])
def test_a_torch_without_an_api_used_is_refused_in_one_line(monkeypatch, owner, name, api):
    monkeypatch.delattr(owner, name)
    with pytest.raises(UnsupportedTorch) as refused:
        check_torch()
    assert str(refused.value) == _refusal(api)


def test_a_torch_whose_new_group_lacks_sort_ranks_is_refused_before_patching(monkeypatch):
    """torch 2.11's ``new_group``: everything but ``sort_ranks``. The refusal comes from
    :func:`compatibility_registry`, which ``install`` and the Megatron-LM adaptor call first."""
    def new_group(ranks=None, timeout=None, backend=None, pg_options=None,
                  use_local_synchronization=False, group_desc=None, device_id=None):
        raise AssertionError("not to be called")

    monkeypatch.setattr(dist, "new_group", new_group)
    with pytest.raises(UnsupportedTorch) as refused:
        compatibility_registry(resolve_device_backend("cpu"))
    assert str(refused.value) == _refusal("torch.distributed.new_group(sort_ranks=...) "
                                          "(new in torch 2.12)")
    assert "\n" not in str(refused.value)


def pipeline_pair_report(tmp_path, worker: str, patched: bool) -> dict:
    """Run ``tests/workers/<worker>`` on two ranks, with the project's patches or without, and
    return what its rank 1 reported."""
    args = [worker_script(worker), str(tmp_path)] + (["--patched"] if patched else [])
    with launch(args, nproc_per_node=2, master_port=free_port()) as job:
        returncode, output = job.wait(timeout=90)
    assert returncode == 0, output
    return json.loads((tmp_path / "rank1.json").read_text())


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("patched", [True, False], ids=["patched", "unpatched"])
def test_pipeline_receives_wait_for_the_op_timeout_not_the_creation_timeout(tmp_path, patched):
    """A gloo group created with 1 s and set to 60 s: megatron-core's pipeline receive waits out
    a peer 3 s late once patched, and fails after about 1 s without the patch."""
    report = pipeline_pair_report(tmp_path, "p2p_wait.py", patched)
    if patched:
        assert report.get("received") == [0.0] * 4, report
        assert report["waited_s"] > 2.5
    else:
        assert "Timed out" in report.get("error", ""), report
        assert report["waited_s"] < 2.5


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("patched", [True, False], ids=["patched", "unpatched"])
def test_a_send_freed_before_it_is_waited_for_arrives_intact_once_patched(tmp_path, patched):
    """megatron-core 0.16.1's interleaved schedule frees an activation before waiting for its
    send: patched, all ten sends arrive as sent; unpatched, the receiver gets the memory's new
    contents (on 0.19 too, whose schedule waits first but whose ``_p2p_ops`` is the same)."""
    report = pipeline_pair_report(tmp_path, "p2p_early_free.py", patched)
    if patched:
        assert report["intact"] == report["sends"], report
    else:
        assert report["intact"] < report["sends"], report


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("operation", ["all_reduce", "coalesced", "recv"])
@pytest.mark.parametrize("patched", [True, pytest.param(False, marks=pytest.mark.sweep)],
                         ids=["patched", "unpatched"])
def test_a_collective_that_nothing_ends_is_abandoned_once_a_failure_is_detected(tmp_path,
                                                                                 patched,
                                                                                 operation):
    """Rank 1 never joins rank 0's all-reduce or coalesced reduce-scatters (a bucket group's
    gradient sync, one work without a future), or never sends what rank 0 receives, and nothing
    fails it: the armed wait gives up as soon as its event is set, and the group it leaves
    behind is destroyed without waiting for gloo's deadline. The retired group (its gloo event
    loop) lives on while the abandoned operation may still be inside it, and is released once
    that operation ended. Unpatched, rank 0 waits until rank 1 exits, 8 s in."""
    args = [worker_script("collective_abandon.py"), str(tmp_path), operation]
    args += ["--patched"] if patched else []
    with launch(args, nproc_per_node=2, master_port=free_port()) as job:
        returncode, output = job.wait(timeout=90)
    assert returncode == 0, output
    report = json.loads((tmp_path / "rank0.json").read_text())
    assert report["first"] == [2.0] * 4, report
    if patched:
        assert report["error"].startswith("CollectiveAbandoned"), report
        assert 0.9 < report["waited_s"] < 3, report
        assert report["destroyed_in_s"] < 1, report
        assert report["pending_retired"], report
        assert report["loops_retired"] == report["loops_before"], report
        assert report["loops_released"] == report["loops_before"] - 1, report
        assert report["released_in_s"] < 1, report
    else:
        assert report["waited_s"] > 6, report


class _Work:
    """A stand-in for a gloo ``Work`` that ends when :meth:`end` is called; with a future (a
    collective) or without one (a point-to-point request). Its wait blocks as torch's does, on
    a lock rather than a Python event."""

    def __init__(self, with_future: bool) -> None:
        self.ended = False
        self._running = threading.Lock()
        self._running.acquire()
        self.future = torch.futures.Future() if with_future else None

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self._running.release()
        if self.future is not None and not self.future.done():
            self.future.set_result(None)

    def is_completed(self) -> bool:
        return self.ended

    def get_future(self) -> torch.futures.Future:
        if self.future is None:
            raise RuntimeError("no future")
        return self.future


def _gloo_wait(work: _Work, timeout: timedelta = timedelta(0)) -> bool:
    """As torch's ``Work.wait``: raises when ``timeout`` passes before the work ends."""
    if not work._running.acquire(timeout=timeout.total_seconds() or -1):
        raise RuntimeError("Operation timed out!")
    work._running.release()
    return True


@pytest.fixture
def polls_of_this_thread(monkeypatch):
    """How many times this thread has slept on a ``threading.Event`` for less than a second."""
    count, this_thread, event_wait = [0], threading.get_ident(), threading.Event.wait

    def counted(event, timeout=None):
        if threading.get_ident() == this_thread and timeout is not None and timeout < 1:
            count[0] += 1
        return event_wait(event, timeout)

    monkeypatch.setattr(threading.Event, "wait", counted)
    return count


@pytest.mark.parametrize("with_future", [True, False], ids=["collective", "point-to-point"])
def test_an_armed_wait_sleeps_until_its_work_ends(with_future, polls_of_this_thread):
    """Armed, a wait does not poll: it sleeps until the work ends (a poll every few milliseconds
    would take the GIL from a training thread computing meanwhile)."""
    work, failure = _Work(with_future), threading.Event()
    distributed_work.abandon_waits_when(failure)
    try:
        threading.Timer(0.5, work.end).start()
        assert distributed_work._abandonable(_gloo_wait)(work, timedelta(seconds=10))
        assert polls_of_this_thread[0] == 0
    finally:
        distributed_work.abandon_waits_when(None)
        work.end()


@pytest.mark.parametrize("ends_after_s", [0.01, 0.3])
def test_a_collective_is_left_to_torch_for_its_first_moments(ends_after_s, monkeypatch):
    """A collective that ends within ``_TORCH_WAIT_S`` is waited for by torch alone; one that
    takes longer is then armed against the failure event."""
    armed = mock.Mock(wraps=distributed_work._abandoned_first)
    monkeypatch.setattr(distributed_work, "_abandoned_first", armed)
    work, failure = _Work(with_future=True), threading.Event()
    distributed_work.abandon_waits_when(failure)
    try:
        threading.Timer(ends_after_s, work.end).start()
        assert distributed_work._abandonable(_gloo_wait)(work, timedelta(seconds=10))
        assert armed.call_count == (0 if ends_after_s < distributed_work._TORCH_WAIT_S else 1)
    finally:
        distributed_work.abandon_waits_when(None)
        work.end()


@pytest.mark.parametrize("with_future", [True, False], ids=["collective", "point-to-point"])
def test_an_armed_wait_is_abandoned_as_soon_as_a_failure_is_detected(with_future,
                                                                     polls_of_this_thread):
    work, late, failure = _Work(with_future), _Work(with_future), threading.Event()
    distributed_work.abandon_waits_when(failure)
    try:
        threading.Timer(0.3, failure.set).start()
        started = time.monotonic()
        with pytest.raises(distributed_work.CollectiveAbandoned):
            distributed_work._abandonable(_gloo_wait)(work, timedelta(seconds=10))
        assert time.monotonic() - started < 0.3 + 0.5
        assert polls_of_this_thread[0] == 0
        # A wait that starts while the failure is being handled is abandoned at once.
        with pytest.raises(distributed_work.CollectiveAbandoned):
            distributed_work._abandonable(_gloo_wait)(late, timedelta(seconds=10))
    finally:
        distributed_work.abandon_waits_when(None)
        work.end()
        late.end()


def _abandoned_in_s(work: _Work, failure: threading.Event, before_the_failure) -> float:
    """Start an armed wait for ``work`` on a thread; once it sleeps, call ``before_the_failure``
    and set ``failure``: how long the wait took to end, 10 if it did not."""
    outcome = {}

    def wait() -> None:
        try:
            distributed_work._abandonable(_gloo_wait)(work, timedelta(seconds=10))
        except distributed_work.CollectiveAbandoned:
            outcome["abandoned_at"] = time.monotonic()

    waiter = threading.Thread(target=wait)
    waiter.start()
    asleep_by = time.monotonic() + 5
    while not distributed_work._wakers and time.monotonic() < asleep_by:
        time.sleep(0.001)
    before_the_failure()
    failed_at = time.monotonic()
    failure.set()
    waiter.join(5)
    return outcome.get("abandoned_at", failed_at + 10) - failed_at


@pytest.mark.parametrize("with_future", [True, False], ids=["collective", "point-to-point"])
def test_a_wait_started_between_a_recovery_and_the_next_failure_is_abandoned(with_future):
    """The failure event is cleared (a recovery ended), a wait starts, and the event is set
    again at once (the next failure): the wait ends as soon as that is seen, not at its
    deadline."""
    work, failure = _Work(with_future), threading.Event()
    distributed_work.abandon_waits_when(failure)
    try:
        failure.set()
        time.sleep(0.1)  # the first failure is seen
        failure.clear()
        assert _abandoned_in_s(work, failure, lambda: None) < 1
    finally:
        distributed_work.abandon_waits_when(None)
        work.end()


@pytest.mark.parametrize("with_future", [True, False], ids=["collective", "point-to-point"])
def test_a_wait_keeps_the_event_it_was_armed_with(with_future):
    """Armed anew with another event (or none) while a wait sleeps, the wait still ends when its
    own event is set."""
    work, failure = _Work(with_future), threading.Event()
    distributed_work.abandon_waits_when(failure)

    def disarmed_for_a_while() -> None:
        distributed_work.abandon_waits_when(None)
        time.sleep(distributed_work._WATCH_S + 0.2)  # long enough for a watcher to look

    try:
        assert _abandoned_in_s(work, failure, disarmed_for_a_while) < 1
    finally:
        distributed_work.abandon_waits_when(None)
        work.end()
