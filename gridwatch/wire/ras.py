"""What a node's NCCL RAS report says, typed: the agent parses it (gridwatch.agent.ras), the console judges it."""

from __future__ import annotations

from enum import StrEnum

import msgspec

from gridwatch.wire.protocol import text_enc_hook


class RasState(StrEnum):
    """What RAS says of a rank or process."""

    DEAD = "dead"  # unreachable via the RAS network
    MISSING = "missing"  # gave no data for a communicator (or for the whole job)
    MISMATCH = "mismatch"  # answered, with a status or operation count unlike its peers'


class RasRank(msgspec.Struct, kw_only=True, frozen=True):
    """One rank (or, outside a communicator, one process) that RAS reports, with where it runs when the report says."""

    state: RasState
    rank: int | None = None  # its rank in the communicator; None for a process line
    pid: int | None = None
    node: str = ""  # the host as RAS prints it (an address, usually)
    gpu: str = ""
    detail: str = ""  # the status or count RAS gives for a mismatch


class RasCommunicator(msgspec.Struct, kw_only=True):
    """One communicator the report flags, by its group label (``#0-0``) and hash, and the ranks it names."""

    label: str
    hash: str
    problem: str  # INCOMPLETE, ERROR, MISMATCH
    ranks: list[RasRank] = []
    notes: list[str] = []  # the lines under it that name no rank


class RasReport(msgspec.Struct, kw_only=True):
    """A parsed RAS status report: the processes and ranks it names, the sections it flags, and the text."""

    version: str = ""  # "NCCL version 2.24.3..." as the report starts
    processes: list[RasRank] = []  # dead or missing job processes (the report's top-level DEAD / INCOMPLETE)
    communicators: list[RasCommunicator] = []
    errors: list[str] = []  # the headlines under "Errors"
    warnings: list[str] = []  # the headlines under "Warnings"
    complete: bool = True  # False when the reply was cut (size bound or timeout after some text)
    text: list[str] = []  # the report's lines, cleaned and bounded

    def culprits(self) -> list[RasRank]:
        """Dead or missing ranks and processes, the ones RAS blames; mismatches are not blamed on their own."""
        out = [r for r in self.processes if r.state in (RasState.DEAD, RasState.MISSING)]
        out += [r for c in self.communicators for r in c.ranks if r.state in (RasState.DEAD, RasState.MISSING)]
        return out

    @property
    def blamed_nodes(self) -> list[str]:
        """The hosts of the culprits, each once, in report order (those the report gives a host for)."""
        return list(dict.fromkeys(r.node for r in self.culprits() if r.node))


_report_decoder = msgspec.json.Decoder(RasReport)


def decode_report(raw: object) -> RasReport:
    """The report a ``ras_status`` result carries (its ``data["report"]``), typed; raises if it does not decode.

    Through JSON: the console hands node text over as its Text type, which a
    plain convert refuses (its strings were cleaned where the frame was decoded).
    """
    return _report_decoder.decode(msgspec.json.encode(raw, enc_hook=text_enc_hook))
