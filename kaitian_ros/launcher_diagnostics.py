"""The launcher's own ``/diagnostics`` status: which of its nodes are up, down or respawned."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING, Any

from kaitian_ros.runtime import zenoh_session as zs

if TYPE_CHECKING:
    from kaitian_ros.launcher import Launcher


class Supervision:
    """The launcher's own /diagnostics (node ``launch``), once a second: per node its pid,
    restarts and last exit code; ERROR while a node is down waiting for its respawn, WARN for
    RECENT_S after a restart, else OK."""

    PERIOD_S = 1.0
    RECENT_S = 30.0

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher
        self.rt: Any = None
        self.next_s = 0.0
        try:
            from kaitian_ros.runtime.diagnostics import DiagnosticsPublisher, Level
            from kaitian_ros.runtime.embedded import EmbeddedRuntime
            from kaitian_ros.runtime.node_args import NodeArgs

            self.level = Level
            self.rt = EmbeddedRuntime(NodeArgs("launch"), router=launcher.connect_endpoint,
                                      security=launcher.security)
            self.diagnostics = DiagnosticsPublisher(self.rt, hardware_id="launcher")
            self.thread = threading.Thread(target=self.rt.spin, daemon=True)  # answers graph queries
            self.thread.start()
        except Exception as exc:  # noqa: BLE001 - supervision goes on without it, whatever failed
            launcher.say(f"[launch] no /diagnostics from the launcher: {exc}")
            self.rt = None

    def maybe_publish(self) -> None:
        now = time.monotonic()
        if self.rt is None or now < self.next_s:
            return
        self.next_s = now + self.PERIOD_S
        values: dict[str, Any] = {}
        down, recent = [], []
        for child in self.launcher.children:
            name = child.spec.name
            running = child.process.poll() is None
            values[f"{name}.pid"] = child.process.pid if running else ""
            values[f"{name}.restarts"] = child.restarts
            values[f"{name}.last_exit"] = "" if child.last_exit is None else child.last_exit
            if child.respawn_at:
                down.append(f"{name} down (exit code {child.last_exit}), respawn in "
                            f"{max(0.0, child.respawn_at - now):.1f} s")
            elif child.restarted_at and now - child.restarted_at < self.RECENT_S:
                recent.append(f"{name} respawned ({child.restarts} restart{'s' * (child.restarts != 1)}, "
                              f"last exit code {child.last_exit})")
        if down:
            level, text = self.level.ERROR, "; ".join(down)
        elif recent:
            level, text = self.level.WARN, "; ".join(recent)
        else:
            level, text = self.level.OK, f"{len(self.launcher.children)} nodes supervised"
        with contextlib.suppress(zs.SessionError):  # the router may be going away with the graph
            self.diagnostics.publish(level, text, values)

    def close(self) -> None:
        if self.rt is not None:
            self.rt.shutdown()
            self.thread.join(timeout=2.0)
            self.rt.close()
            self.rt = None
