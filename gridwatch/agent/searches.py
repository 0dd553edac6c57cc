"""A console's search of the node's buffered log lines: run in a worker, one at a time per key, fitted to one frame."""

from __future__ import annotations

from gridwatch.agent.base import AgentBase
from gridwatch.agent.logsearch import SearchRefused, SearchTimeout, search_entries
from gridwatch.wire import protocol as p

# Search workers running at once on a node, whoever asked.
MAX_SEARCHES = 2


class Searching(AgentBase):
    """The log search a console asks of this node."""

    async def search(self, req: p.Search, key: str = "") -> p.SearchResult:
        """Search the buffered log lines in a worker process: the event loop only waits for it.

        One search at a time per client ``key``, so one viewer cannot hold every worker.
        """
        if self.tailer is None:
            return p.SearchResult(id=req.id)
        if key and key in self._searching:
            return p.SearchResult(id=req.id, error=p.Text("busy: this key's previous search is still running; wait for its answer"))
        if self.searches >= MAX_SEARCHES:
            return p.SearchResult(id=req.id, error=p.Text(f"busy: {MAX_SEARCHES} searches are running on this node; try again shortly"))
        limit = min(max(req.limit, 1), 5000)
        self.searches += 1
        self._searching.add(key)
        try:
            # The whole buffer in one copy, filtered here: the logs source appends to it from its own thread.
            entries = [e for e in self.tailer.entries() if (req.since is None or e[2] >= req.since)
                       and (req.until is None or e[2] <= req.until)]
            found = await search_entries(entries, str(req.pattern), limit + 1, self.config.search_timeout)
        except SearchRefused as exc:
            return p.SearchResult(id=req.id, error=p.Text(f"refused pattern: {exc}"))
        except SearchTimeout as exc:
            self.log.warning("a search for {!r} was stopped at its deadline", p.clean_text(str(req.pattern), 100))
            return p.SearchResult(id=req.id, error=p.Text(f"search timed out: {exc}"))
        except ValueError as exc:
            return p.SearchResult(id=req.id, error=p.Text(f"bad pattern: {exc}"))
        finally:
            self.searches -= 1
            self._searching.discard(key)
        truncated = len(found) > limit
        lines = [p.LogLine(source=p.Text(src), line=p.Text(text), line_ts=ts, node=self.node) for src, text, ts in found[-limit:]]
        kept = _fit_frame(lines)
        return p.SearchResult(id=req.id, lines=lines[len(lines) - kept:], truncated=truncated or kept < len(lines))


def _fit_frame(lines: list[p.LogLine]) -> int:
    """How many of the newest ``lines`` fit in one frame the console accepts (``MAX_FRAME_BYTES``)."""
    room = p.MAX_FRAME_BYTES - 4096  # the result's own fields
    kept = 0
    for line in reversed(lines):
        room -= len(p.encode(line)) + 1
        if room < 0:
            break
        kept += 1
    return kept
