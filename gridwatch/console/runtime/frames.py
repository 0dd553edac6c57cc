"""Frames in: what the fleet hands the runtime (frames, link states, relays up and down) to the store and the engine.

This is the console's hot path, measured in µs per frame (benchmarks/bench_console_frame.py).
"""

from __future__ import annotations

from typing import Any

from loguru import logger

from gridwatch.console.runtime.plans import Launching
from gridwatch.wire.protocol import Event, Frame, LogLine, Sample, Summary, fault_time


class Observing(Launching):
    """Frames, link states and relays, as the fleet calls them in."""

    # Callbacks the fleet calls; they must stay cheap (O(frame)): the UI reads on its own tick.
    def on_frame(self, link: Any, frame: Frame) -> None:
        key = str(link.endpoint)
        self.store.apply(frame, key)
        reading = False
        if isinstance(frame, (Summary, Sample)):
            reading = True
            if frame.trainer is not None:
                self.goodput.observe(key, frame.trainer, len(frame.gpus))
        engine = self.engine
        if engine is not None:
            symptom = not reading and isinstance(frame, (Event, LogLine))
            before = engine.clock.now() if symptom else 0.0
            try:
                plans = engine.observe(key, frame)
            except Exception:  # noqa: BLE001 - one bad frame must not stop the stream
                logger.bind(node=key).exception("playbook engine failed on a frame")
                plans = []
            if symptom:
                # The fault's own time: a trainer told gone after its grace began to fail when it went silent.
                ts = fault_time(frame) if isinstance(frame, Event) else frame.ts
                self._symptoms.append((before, engine.clock.now(), ts))
                self.hangs.on_frame(str(frame.node) or str(link.name), frame)
            if plans:
                self._launch(plans)
        hooks = self.hooks.frame
        if hooks:
            for hook in hooks:
                hook(link, frame)

    def on_status(self, link: Any) -> None:
        hello_name = str(link.hello.node) if getattr(link, "hello", None) is not None else None
        self.store.set_link(
            str(link.endpoint), str(link.state), name=hello_name or link.name, error=link.last_error, role=link.role,
            foreign_frames=link.foreign_frames,
        )
        endpoint = str(link.endpoint)
        if str(link.state) == "connected":
            if endpoint not in self._up:
                self._up.add(endpoint)
                self.collector.links = len(getattr(self.fleet, "links", ()))
                self.collector.link_up()
        else:
            self._up.discard(endpoint)
        if str(link.state) != "connecting":
            self._tried.add(endpoint)
            if not self._links_tried.is_set() and self._all_tried():  # the scan of every link only until then
                self._links_tried.set()
                # What lives as long as the console (modules, playbooks, the app, a state per node)
                # is kept out of the collector's full walks (console/runtime/collector.py).
                self.collector.settled()
        for hook in self.hooks.link:
            hook(link)

    def on_relay(self, relay: Any) -> None:
        """A relay's own link went up or down: one line for all the nodes behind it (its nodes say it too)."""
        key = str(relay.endpoint)
        if self.engine is not None:
            # The relay's silence is the relay's: no node behind it is lost for it.
            if str(relay.state) == "connected":
                self.engine.relay_up(list(relay.carried), self.engine.clock.now())
            else:
                self.engine.relay_down(list(relay.carried), key)
        if str(relay.state) == "connected":
            self.relays_down.pop(key, None)
        else:
            behind = len(relay.carried)
            self.relays_down[key] = f"{relay.last_error or f'relay {key} is down'} ({behind:,} node{'s' * (behind != 1)} behind it)"
        self.store.generation += 1
        self.store.news += 1
        for hook in self.hooks.relay:
            hook(relay)

    @property
    def relay_alert(self) -> str:
        """The relays down, in one line ("" when none is)."""
        down = self.relays_down
        if len(down) <= 1:
            return next(iter(down.values()), "")
        names = sorted(down)
        return f"{len(down)} relays down: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"
