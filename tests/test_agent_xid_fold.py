"""One fault, one event: an XID that NVML and the kernel log both report is sent once by the agent."""

from __future__ import annotations

from gridwatch.wire import protocol as p
from tests.conftest import start_agent, stop_agent


async def test_one_xid_seen_by_nvml_and_by_the_kernel_log_is_one_event(keys):
    """The driver prints the XID it also reports through NVML: the agent sends one event, not two."""
    from gridwatch.agent.detectors import detect

    ra = await start_agent(keys, gpus=2)
    try:
        agent = ra.agent
        bus = str(agent.gpu_info[1].pci_bus_id)
        nvml = p.Event(kind=p.Text("xid"), code=79, gpu=1, severity=p.Text("critical"), source=p.Text("nvml"))
        line = f"NVRM: Xid (PCI:{bus}): 79, pid=1234, GPU has fallen off the bus."
        kernel = detect(line, "/dev/kmsg", 0.0)
        assert kernel is not None and kernel.gpu is None
        assert not agent._told_already(nvml)
        assert agent._told_already(kernel) and agent.folded_xids == 1  # the same fault, from the kernel
        other = p.Event(kind=p.Text("xid"), code=79, gpu=0, severity=p.Text("critical"), source=p.Text("nvml"))
        assert not agent._told_already(other)  # another GPU's is its own
    finally:
        await stop_agent(ra)
