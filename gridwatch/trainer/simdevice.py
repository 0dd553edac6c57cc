"""The trainer's simulated-device hook: a simulated GPU fault hurts the training process as the real one would.

Only on when the devices are simulated: the demo sets ``GRIDWATCH_SIM_DEVICES``
(see :mod:`gridwatch.wire.simdevices`) for its agents and its trainer, and a worker
that trains on CUDA never turns it on (its hooks are then :class:`DeviceFaults`,
which do nothing). The worker asks the hook before each step; the hook reads
the node's fault file and

- fell off the bus (XID 79): blocks where the next collective would, for the
  collective timeout, then dies with the CUDA error torch prints; a new
  process on that node fails at start until the fault is cleared;
- uncorrectable ECC (XID 48): dies with "uncorrectable ECC error
  encountered"; new processes too, until the GPU is reset;
- XID 13 / 31: the process that was running dies (illegal memory access); a
  restarted one trains (the node is healthy);
- thermal: every step takes longer, as at throttled clocks (a straggler);
- a link flap: collectives slow down, then fail with NCCL's network error;
- a hang: stuck in the next collective (called, never started) until the fault is cleared;
- a spin (no GPU fault): the training thread loops in Python before its next collective.

Lines that torch, NCCL and CUDA would print go to the worker's stderr (the
trainer's log), in the formats of real logs; the source of each is beside it.
A collective that times out ends the process as NCCL's watchdog does
(``TORCH_NCCL_ASYNC_ERROR_HANDLING``'s default), so torchrun starts it again.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

from loguru import logger

from gridwatch.wire.simdevices import DeviceFault, DeviceState, read_state, sim_dir, state_path

# Throttled SM clock over the normal one in the simulated readings (1095 vs 1980 MHz): steps take this much longer.
THERMAL_SLOWDOWN = 1980.0 / 1095.0
FLAP_SLOW_S = 3.0  # a flapping link first slows every collective for this long...
FLAP_DELAY_S = 0.4  # ...by this much each, then the collective fails
AT_START_HOLD_S = 10.0  # a process that cannot use its GPU fails after this (torchrun then starts it again)
POLL_S = 0.2

# torch's message for a failed CUDA call, and the two lines it adds (seen as printed in
# jade-hpc-gpu/jade-hpc-gpu.github.io issue 194 and huggingface/accelerate issue 1192).
_CUDA_TAIL = ("CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below "
              "might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1.\n"
              "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n")
CUDA_ERRORS = {
    DeviceFault.LOST: "unspecified launch failure",
    DeviceFault.ECC_DBE: "uncorrectable ECC error encountered",
    DeviceFault.APP_CRASH: "an illegal memory access was encountered",
}

Exit = Callable[[int], None]
LeaveAsked = Callable[[], bool]


class Leave(Exception):
    """The operator asked this node to leave while its GPU is lost: it goes, the others re-form."""


class DeviceFaults:
    """The worker's device hooks, at the points where a GPU's fault would hurt the training process.

    This default does nothing: a real GPU's faults hurt the process by themselves.
    """

    def at_start(self) -> None:
        """Before the process joins the job."""

    def before_step(self, leave_asked: LeaveAsked) -> None:
        """Where the step's first collective starts; may raise :class:`Leave` if ``leave_asked()``."""

    def throttle(self, compute_s: float) -> None:
        """After the step's compute, which took ``compute_s``."""

    def in_collective(self) -> None:
        """Where a collective has been called but not started."""

    def on_collective_error(self, exc: BaseException, op: str = "ALLREDUCE", seq: int = 0) -> None:
        """A collective of the step failed with ``exc``."""


class SimDevice(DeviceFaults):
    """One worker's view of its node's simulated GPUs (see the module docstring)."""

    def __init__(self, node: str, rank: Callable[[], int], collective_timeout_s: float, exit: Exit,
                 clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep) -> None:
        directory = sim_dir()
        assert directory is not None
        self.node = node
        self.path = state_path(directory, node)
        self.rank = rank
        self.timeout = collective_timeout_s
        self.exit = exit
        self.clock = clock
        self.sleep = sleep
        self.started = clock()
        self.flaps_failed: set[int] = set()
        self.log = logger.bind(node=node)

    @classmethod
    def from_env(cls, node: str, rank: Callable[[], int], collective_timeout_s: float, exit: Exit,
                 backend: str) -> DeviceFaults:
        """The simulated device if this worker's devices are simulated (the variable is set and it trains
        without CUDA); else the hooks that do nothing."""
        if sim_dir() is None or backend == "nccl":
            return DeviceFaults()
        return cls(node, rank, collective_timeout_s, exit)

    def state(self) -> DeviceState:
        return read_state(self.path, self.node)

    # --------------------------------------------------------------- start

    def at_start(self) -> None:
        """Before joining: a lost or ECC-failed GPU fails the new process; a hung one keeps it waiting."""
        while self.state().has(DeviceFault.HANG) is not None:
            self.sleep(POLL_S)
        for fault in (DeviceFault.LOST, DeviceFault.ECC_DBE):
            if self.state().has(fault) is None:
                continue
            deadline = self.clock() + AT_START_HOLD_S
            while self.clock() < deadline and self.state().has(fault) is not None:
                self.sleep(POLL_S)
            if self.state().has(fault) is not None:
                self._die(fault, "torch.cuda.init()")

    # ---------------------------------------------------------------- step

    def before_step(self, leave_asked: LeaveAsked) -> None:
        """Where the step's first collective starts; blocks, dies or raises as the fault would."""
        state = self.state()
        if not state.faults:
            return
        crash = state.has(DeviceFault.APP_CRASH)
        if crash is not None and crash.at >= self.started:
            self._die(DeviceFault.APP_CRASH, "loss.backward()")
        if state.has(DeviceFault.ECC_DBE) is not None:
            self._die(DeviceFault.ECC_DBE, "loss.backward()")
        if state.has(DeviceFault.LOST) is not None:
            self._lost(leave_asked)
        if state.has(DeviceFault.SPIN) is not None:
            self._spin()
        flap = state.has(DeviceFault.LINK_FLAP)
        if flap is not None and flap.seq not in self.flaps_failed:
            self._flap(flap.at, flap.seq)

    def throttle(self, compute_s: float) -> None:
        """A thermally throttled GPU computes at its lowered clock: the step's compute takes longer."""
        if compute_s > 0 and self.state().has(DeviceFault.THERMAL) is not None:
            self.sleep(compute_s * (THERMAL_SLOWDOWN - 1.0))

    def _lost(self, leave_asked: LeaveAsked) -> None:
        # The kernels already queued never finish: the collective waits on them, its peers wait on it.
        self.log.warning("simulated GPU fell off the bus: blocked in the next collective for up to {:.0f} s",
                         self.timeout)
        deadline = self.clock() + self.timeout
        while self.clock() < deadline:
            if leave_asked():
                raise Leave()
            if self.state().has(DeviceFault.LOST) is None:
                return  # cleared (a reset): the collective goes on; its peers may have given up already
            self.sleep(POLL_S)
        self._die(DeviceFault.LOST, "dist.all_reduce(grads)")

    def in_collective(self) -> None:
        """Where a collective has been called but not started: a hung GPU never starts it (the peers wait in it)."""
        if self.state().has(DeviceFault.HANG) is None:
            return
        self.log.warning("simulated GPU hang: stuck in the collective until the fault is cleared")
        while self.state().has(DeviceFault.HANG) is not None:
            self.sleep(POLL_S)

    def _spin(self) -> None:
        # Busy in Python, as a host-side loop that never ends would be: the interpreter
        # switches threads between bytecodes, so the control thread still answers.
        self.log.warning("simulated spin: the training thread loops before its next collective until cleared")
        while self.state().has(DeviceFault.SPIN) is not None:
            deadline = time.monotonic() + POLL_S
            while time.monotonic() < deadline:
                pass

    def _flap(self, at: float, seq: int) -> None:
        if self.clock() - at < FLAP_SLOW_S:
            self.sleep(FLAP_DELAY_S)  # retransmissions while the link retrains
            return
        self.flaps_failed.add(seq)
        # NCCL's warning for a lost IB connection: format of NVIDIA/nccl issue 1814 (values ours);
        # the RuntimeError's text is written by us after NCCL's ncclRemoteError description.
        pid = os.getpid()
        sys.stderr.write(
            f"{os.uname().nodename}:{pid}:{pid} [0] ib_plugin.c:1615 NCCL WARN NET/IB : Got completion from peer "
            "10.0.0.2<44206> with status=12 opcode=1 len=0 vendor err 129 (Send) localGid ::ffff:10.0.0.1 "
            "remoteGids::ffff:10.0.0.2\n")
        sys.stderr.flush()
        raise RuntimeError("NCCL error: remote process exited or there was a network error (ncclRemoteError), "
                           "simulated link flap")

    def _die(self, fault: DeviceFault, where: str) -> None:
        """Print what torch prints for this CUDA error, and end the process as the uncaught error would."""
        error = CUDA_ERRORS[fault]
        sys.stderr.write(
            "Traceback (most recent call last):\n"
            '  File "trainer/worker.py", line 1, in train_step\n'
            f"    {where}\n"
            f"RuntimeError: CUDA error: {error}\n{_CUDA_TAIL}")
        sys.stderr.flush()
        self.log.error("training stopped: CUDA error: {} (simulated {})", error, fault.value)
        self.exit(1)

    # ------------------------------------------------------------ timeouts

    def on_collective_error(self, exc: BaseException, op: str = "ALLREDUCE", seq: int = 0) -> None:
        """A collective that timed out ends the process as NCCL's watchdog does; any other error is left alone."""
        text = str(exc).lower()
        if "timed out" not in text and "timeout" not in text:
            return
        ms = int(self.timeout * 1000)
        rank = self.rank()
        stamp = time.strftime("%m%d %H:%M:%S", time.localtime())
        # ProcessGroupNCCL's watchdog lines (format of hiyouga/LlamaFactory issue 7396 and
        # XPixelGroup/BasicSR issue 737; values ours).
        sys.stderr.write(
            f"[rank{rank}]:[E{stamp}.000000000 ProcessGroupNCCL.cpp:616] [Rank {rank}] Watchdog caught collective "
            f"operation timeout: WorkNCCL(SeqNum={seq}, OpType={op}, NumelIn=1, NumelOut=1, Timeout(ms)={ms}) "
            f"ran for {ms + 13} milliseconds before timing out.\n"
            f"[rank{rank}]:[E{stamp}.000000000 ProcessGroupNCCL.cpp:1785] [PG ID 0 PG GUID 0(default_pg) Rank {rank}] "
            f"Exception (either an error or timeout) detected by watchdog at work: {seq}, last enqueued NCCL work: "
            f"{seq}, last completed NCCL work: {seq - 1}.\n")
        sys.stderr.flush()
        self.log.error("collective timed out after {:.0f} s: the process ends, as NCCL's watchdog ends it", self.timeout)
        self.exit(1)
