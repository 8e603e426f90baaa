"""The faults of ``kaitian bench chaos``: how each is injected into a running graph and what it
reports beside the common measurement of :class:`kaitian_ros.bench.chaos_run.Run`."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from kaitian_ros.bench import chaos_metrics as cm
from kaitian_ros.bench.chaos_forgeries import forgery_variants, fuzz_seeds
from kaitian_ros.bench.chaos_graph import incarnation_hex
from kaitian_ros.bench.chaos_report import plan_lines, plan_text, rounded, skipped
from kaitian_ros.bench.chaos_run import Injected, Run
from kaitian_ros.bench.chaos_settings import COMPUTE_CERT, LINK_NODE, RETIRED
from kaitian_ros.processes import start_child


class FaultRun(Run):
    """A :class:`Run` with one method per fault: each injects its fault into the graph and says
    what it did (:class:`Injected`); :func:`run_fault` picks the method by the fault's name."""

    # --- kills -------------------------------------------------------------------------
    def kill_compute(self) -> Injected:
        g = self.g
        victim = g.busiest_compute()
        before = g.latest_plan()
        t, pid = g.kill(victim)

        def after(start: float, until: float) -> dict[str, Any]:
            re = g.respawned(victim, t)
            ready = g.ready_after(victim, re[0]) if re else None
            plans = g.plans_between(t, until)
            left = next((pt for pt, m in plans if victim not in list(m.node_ids)), None)
            back = next((pt for pt, m in plans if left is not None and pt > left and victim in list(m.node_ids)), None)
            return {"victim": victim, "old_pid": pid, "new_pid": re[1] if re else None,
                    "respawned_after_s": rounded(re[0] - t, 2) if re else None,
                    "respawned_from": g.respawned_how(victim, t) if re else None,
                    "ready_after_s": rounded(ready - t, 2) if ready else None,
                    "plan_before": plan_text(before), "left_plan_after_s": rounded(left - t, 2) if left else None,
                    "back_in_plan_after_s": rounded(back - t, 2) if back else None,
                    "redispatched": g.counter("coordinator", "redispatched", start, until, "incarnation"),
                    "timeouts": g.counter("coordinator", "timeouts", start, until, "incarnation"),
                    "plans": plan_lines(plans, t)}

        return Injected(end=t, ref=t, after=after)

    def kill_authority(self, name: str) -> Injected:
        g = self.g
        if g.child(name) is None:
            raise LookupError(name)
        old = g.latest_plan() if name == "coordinator" else g.latest_assignment()
        old_inc = int(old.incarnation) if old is not None else 0
        max_id_before = g.latest_request_id()
        t, pid = g.kill(name)
        inj = Injected(end=t, ref=t)

        def after(start: float, until: float) -> dict[str, Any]:
            re = g.respawned(name, t)
            ready = g.ready_after(name, re[0]) if re else None
            if name == "coordinator":
                inj.down.append((t, ready if ready is not None else until))
            msgs = g.plans_between(t, until) if name == "coordinator" else g.assignments_between(t, until)
            new = next(((mt, m) for mt, m in msgs if int(m.incarnation) != old_inc), None)
            followers = g.compute_names if name == "coordinator" else ["coordinator"]
            key = "coordinator_incarnation" if name == "coordinator" else "scheduler_incarnation"
            followed: dict[str, float | None] = {}
            if new is not None:
                for f in followers:
                    followed[f] = next((dt for dt, v in g.diag_series(f, new[0], until)
                                        if v.get(key) == incarnation_hex(new[1].incarnation) and dt >= new[0]), None)
            adaptation = new is not None and all(v is not None for v in followed.values())
            out = {"victim": name, "old_pid": pid, "new_pid": re[1] if re else None,
                   "respawned_after_s": rounded(re[0] - t, 2) if re else None,
                   "ready_after_s": rounded(ready - t, 2) if ready else None,
                   "old_incarnation": incarnation_hex(old_inc),
                   "new_incarnation": incarnation_hex(new[1].incarnation) if new else None,
                   f"new_{'plan' if name == 'coordinator' else 'assignment'}_after_s":
                       rounded(new[0] - t, 2) if new else None,
                   "followed_after_s": {f: rounded(v - t, 2) if v else None for f, v in followed.items()},
                   "adaptation": adaptation,
                   "adaptation_s": rounded(max(v for v in followed.values() if v is not None) - t, 2)
                   if adaptation and followed else None}
            if name == "coordinator":
                with g.rec.lock:
                    ids = [rid for rt, rid in g.rec.request_ids if rt > t]
                out["request_ids_continue_above"] = (min(ids) > max_id_before) if ids else None
            return out

        inj.after = after
        return inj

    def kill_router(self) -> Injected:
        g = self.g
        t, pid = g.kill("router")

        def after(start: float, until: float) -> dict[str, Any]:
            re = g.respawned("router", t)
            since = re[0] if re else until
            plan, assignment = g.latest_plan(), g.latest_assignment()
            # after the router's restart the control plane's latched state must agree end to end
            followed = plan is not None and all(
                g.diag(n).get("coordinator_incarnation") == incarnation_hex(plan.incarnation) for n in g.compute_names)
            proposal = assignment is not None and g.diag("coordinator").get("scheduler_version") == str(
                int(assignment.version))
            fresh = (g.diag_time("coordinator") or 0.0) > since and (g.diag_time("scheduler") or 0.0) > since
            return {"victim": "router", "old_pid": pid, "new_pid": re[1] if re else None,
                    "respawned_after_s": rounded(re[0] - t, 2) if re else None,
                    "adaptation": bool(re and followed and proposal and fresh),
                    "compute_nodes_follow_plan": followed, "coordinator_follows_assignment": proposal,
                    "diagnostics_after_restart": fresh}

        return Injected(end=t, ref=t, after=after)

    # --- flood -------------------------------------------------------------------------
    def flood_prepare(self) -> None:
        """Start the flood's attacker before the pre-fault window (its imports and model build
        take seconds of CPU); it floods on "go"."""
        g, s = self.g, self.s
        victim = g.busiest_compute()
        p = g.scenario.node(victim).parameters
        cmd = [sys.executable, "-u", "-m", "kaitian_ros.bench.chaos_attack", "flood", "--node", victim,
               "--seconds", str(s.flood_s), "--rate", str(s.flood_rate), "--model", str(p["model"]),
               "--height", str(p["input_height"]), "--width", str(p["input_width"]),
               "--num-classes", str(p["num_classes"]), "--slab-rows", str(p["slab_rows"]), "--wait-go"]
        cmd += ["--whole-stripes"] if s.flood_whole_stripes else []
        proc = start_child(cmd, own_group=False, env=dict(os.environ, KAITIAN_ROUTER=g.endpoint),
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        assert proc.stdout is not None and proc.stderr is not None  # started with pipes
        line = proc.stdout.readline()
        if '"ready"' not in line:
            proc.kill()
            raise RuntimeError(f"the flood attacker did not start: {line.strip()} {proc.stderr.read()[-600:]}")
        self._flood = (victim, proc)

    def flood(self) -> Injected:
        g, s = self.g, self.s
        victim, proc = self._flood
        stopped: list[str] = []

        def guard(why: str) -> None:
            if proc.poll() is None and not stopped:
                stopped.append(why)
                proc.send_signal(signal.SIGTERM)

        g.guards.append(guard)
        start = time.monotonic()
        assert proc.stdin is not None  # started with pipes
        proc.stdin.write("go\n")
        proc.stdin.flush()
        try:
            out, err = proc.communicate(timeout=s.flood_s + 60.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        finally:
            g.guards.remove(guard)
        end = time.monotonic()
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        stats = json.loads(lines[-1]) if lines else {"error": err.strip()[-400:]}

        def after(start: float, until: float) -> dict[str, Any]:
            plans = g.plans_between(start, until)
            left = next((pt for pt, m in plans if victim not in list(m.node_ids)), None)
            return {"victim": victim, "attacker": stats, "stopped_early": stopped[0] if stopped else None,
                    "victim_rejected": g.reasons(victim, start, until + 1.5),
                    "victim_left_plan_after_s": rounded(left - start, 2) if left else None,
                    "timeouts": g.counter("coordinator", "timeouts", start, until, "incarnation"),
                    "plans": plan_lines(plans, start)}

        return Injected(end=end, ref=end, start=start, after=after)

    # --- link collapse -----------------------------------------------------------------
    def link_collapse(self) -> Injected:
        g, s = self.g, self.s
        before = g.latest_plan()
        sent0 = _tbf_bytes(g.links)
        t0 = time.monotonic()
        g.links.set_rate(0, s.collapse_mbit)
        try:
            end_at = t0 + s.collapse_s
            while time.monotonic() < end_at:
                g.check()
                time.sleep(0.1)
        finally:
            g.links.set_rate(0, s.link_mbit)
        end = time.monotonic()
        sent = {dev: n - sent0.get(dev, 0) for dev, n in _tbf_bytes(g.links).items()}

        def after(start: float, until: float) -> dict[str, Any]:
            plans = g.plans_between(start, until)
            left = next((pt for pt, m in plans if pt <= end and LINK_NODE not in list(m.node_ids)), None)
            back = next((pt for pt, m in plans
                         if left is not None and pt > end and LINK_NODE in list(m.node_ids)), None)
            alive = [(dt, v.get("alive", "")) for dt, v in g.diag_series("coordinator", start, until)]
            dropped = next((dt for dt, a in alive if LINK_NODE not in a.split(",")), None)
            return {"node": LINK_NODE, "rate_mbit": s.link_mbit, "collapsed_to_mbit": s.collapse_mbit,
                    "collapse_s": rounded(end - start, 1), "plan_before": plan_text(before),
                    "bytes_through_tbf_during_collapse": sent,
                    "node_declared_dead_after_s": rounded(dropped - start, 2) if dropped else None,
                    "left_plan_after_s": rounded(left - start, 2) if left else None,
                    "back_in_plan_after_restore_s": rounded(back - end, 2) if back else None,
                    "timeouts": g.counter("coordinator", "timeouts", start, until, "incarnation"),
                    "redispatched": g.counter("coordinator", "redispatched", start, until, "incarnation"),
                    "plans": plan_lines(plans, start)}

        return Injected(end=end, ref=end, start=t0, after=after)

    # --- forgeries ---------------------------------------------------------------------
    def forge(self, kind: str) -> Injected:
        """Each forged message of ``kind`` from each attacker in turn; with the security option,
        the plausible one of an attacker holding a node certificate goes last (it may take an
        authority over)."""
        g, s = self.g, self.s
        attackers = self.attackers()
        authority = {"plan": "coordinator", "assignment": "scheduler"}.get(kind)
        t0 = time.monotonic()
        done = []
        joined = [(who, a) for who, a, _ in attackers if a is not None]  # in order: the strongest last
        for who, attacker in joined:
            for v in forgery_variants(g, kind):
                watch = list(v.listeners) + ([authority] if authority else [])
                before = {n: g.diag(n) for n in watch}
                tv = time.monotonic()
                attacker.publish(v.topic, v.cdr)
                time.sleep(s.variant_s)
                g.wait_diag_after(watch, tv + 1.05)
                counts = {n: cm.reason_increase([("", before[n]), ("", g.diag(n))]) for n in watch}
                # a listener that took the authority's answer to this impostor first (a new
                # incarnation) refuses the forgery as of a retired incarnation: counted all the same
                counted = bool(v.reason) and all(counts[n].get(v.reason, 0) + counts[n].get(RETIRED, 0) >= 1
                                                 for n in v.listeners)
                effect = v.marker(tv)  # at any time after it was sent (an authority may undo it at once)
                row = {"name": v.name, "attacker": who, "implausible": v.implausible, "what": v.what,
                       "listeners": list(v.listeners), "expected_reason": v.reason, "counted": counted,
                       "rejected": counts, "effect": effect, "consequence": v.consequence if effect else ""}
                # what the listeners and the authority logged about incarnations (who followed whom, when)
                heads = tuple(f"[{n}] " for n in watch)
                row["log"] = [f"+{lt - tv:.3f} s {line[:200]}" for lt, line in g.out.between(tv)
                              if line.startswith(heads) and ("incarnation" in line or "impostor" in line)][:12]
                if authority:  # the authority watches its own topic (impostors), and may re-announce
                    row["authority"] = {"name": authority, "impostor_counted": counts[authority].get("impostor", 0),
                                        "reincarnated": g.diag(authority).get("incarnation")
                                        != before[authority].get("incarnation")}
                done.append(row)
        for who, joined_as, why in attackers:
            if joined_as is None:  # it could not join: nothing it could send reached anyone
                done.append({"name": "all", "attacker": who, "implausible": None, "what": "could not join the graph",
                             "listeners": [], "expected_reason": "", "counted": False, "rejected": {},
                             "effect": False, "consequence": "", "refused": why})
        end = time.monotonic()
        effect = _any_effect(d["effect"] for d in done if d["attacker"] != COMPUTE_CERT)
        inj = Injected(end=end, ref=end, start=t0, details={"variants": done}, effect=effect)
        inj.details["attackers"] = [who for who, _, _ in attackers]
        if any(d["attacker"] == COMPUTE_CERT for d in done):
            inj.top["forgery_effect_compute_certificate"] = _any_effect(
                d["effect"] for d in done if d["attacker"] == COMPUTE_CERT)

        def repair() -> str:
            # what is still taken over after the window (an authority may have re-announced
            # itself already); forged telemetry leaves the scheduler's request count ahead
            names = _taken_over(g.takeovers())
            if kind == "telemetry" and (effect or inj.top.get("forgery_effect_compute_certificate")):
                names = sorted(set(names) | {"scheduler"})
            return self.repair(names) if names else "nothing to repair: every listener follows the real authorities"

        inj.repair = repair
        return inj

    def repair(self, names: Sequence[str]) -> str:
        """Kill -9 the authorities a forgery took over; the launcher respawns them (a new
        incarnation, which every listener follows)."""
        g = self.g
        t = time.monotonic()
        for name in names:
            old = g.diag(name).get("incarnation")
            g.kill(name)
            end = time.monotonic() + 60.0
            while time.monotonic() < end:
                g.check()
                new = g.diag(name).get("incarnation")
                mine = [x for x in g.takeovers() if x.startswith("coordinator follows") == (name == "scheduler")]
                if new and new != old and not mine:
                    break
                time.sleep(0.2)
        ok, _ = g.wait_healthy(60.0, self.baseline_ms)
        left = g.takeovers()
        return (f"{', '.join(names)} killed and respawned; after {time.monotonic() - t:.1f} s every listener follows "
                f"the real authorities: {'yes' if not left else 'NO (' + '; '.join(left) + ')'}, graph "
                f"{'healthy' if ok else 'NOT healthy'}")

    # --- fuzz --------------------------------------------------------------------------
    def fuzz(self) -> Injected:
        g, s = self.g, self.s
        attacker = self.attacker_for()
        seeds = fuzz_seeds(g)
        t0 = time.monotonic()
        restarts0 = g.restarts()
        topics: dict[str, Any] = {}
        takeovers: dict[str, str] = {}  # what a fuzzed LoadAssignment took over -> by which topic
        uncounted, hangs = 0, 0
        for topic, (type_name, seed, listeners) in seeds.items():
            g.check()
            rate = min(s.fuzz_msgs_per_s, s.fuzz_bytes_per_s / max(1, len(seed)))
            before = {n: g.diag(n) for n in listeners}
            tb = time.monotonic()
            reply = attacker.command(timeout_s=s.fuzz_count / rate + 120.0, op="fuzz", topic=topic,
                                     seed_b64=base64.b64encode(seed).decode(), count=s.fuzz_count, rate=rate,
                                     seed=len(topics))
            te = time.monotonic()
            settled = self._wait_counts_settle(listeners, te)
            per: dict[str, Any] = {}
            for n in listeners:
                diag_after = g.diag(n)
                fresh = (g.diag_time(n) or 0.0) > te
                reasons = cm.reason_increase([("", before[n]), ("", diag_after)])
                runtime = sum(reasons.get(k, 0)
                              for k in ("malformed", "wrong type", "type hash mismatch", "queue full"))
                expected = reply["undecodable"] + reply["wrong_type"]
                exact = reasons.get("queue full", 0) == 0
                missing = max(0, expected - runtime) if not exact else (
                    abs(reasons.get("malformed", 0) - reply["undecodable"])
                    + abs(reasons.get("wrong type", 0) - reply["wrong_type"]))
                exc = g.exceptions(tb, time.monotonic()).get(n, 0)
                uncounted += missing + exc
                hangs += 0 if fresh else 1
                per[n] = {"rejected": reasons, "expected_runtime_rejects": expected,
                          "runtime_rejects": runtime, "accounting": "exact" if exact else "at least (queue full)",
                          "missing": missing, "unhandled_exceptions": exc, "diagnostics_after": fresh}
            g.wait_diag_after(g.compute_names + ["coordinator", "scheduler"], te)
            taken = g.takeovers()
            for line in taken:
                if line not in takeovers:
                    takeovers[line] = topic
            topics[topic] = {"type": type_name, "sent": reply["sent"], "undecodable": reply["undecodable"],
                             "wrong_type": reply["wrong_type"], "decodable": reply["decodable"],
                             "by_class": reply["by_class"], "rate": round(rate), "seconds": reply["seconds"],
                             "counts_settled": settled, "subscribers": per,
                             "serving_after": len(g.latencies(te, time.monotonic())) > 0,
                             "authority_taken_over": [line for line, by in takeovers.items() if by == topic]}
            print(f"    fuzz {topic}: {reply['sent']} sent ({reply['undecodable']} undecodable, "
                  f"{reply['wrong_type']} wrong type) in {reply['seconds']} s; "
                  + ", ".join(f"{n}: {v['runtime_rejects']} counted, {v['missing']} missing" for n, v in per.items()),
                  flush=True)
        end = time.monotonic()
        restarts = g.restarts()
        crashes = sum(restarts.get(n, 0) - restarts0.get(n, 0) for n in restarts)
        inj = Injected(end=end, ref=end, start=t0)

        def after(start: float, until: float) -> dict[str, Any]:
            return {"topics": topics, "serving_after": len(g.latencies(until - 5.0, until)) > 0}

        inj.after = after
        inj.top = {"crashes": crashes, "hangs": hangs, "uncounted": uncounted,
                   "authority_taken_over": sorted(takeovers)}
        inj.details = {"per_topic": s.fuzz_count}
        if takeovers:
            inj.repair = lambda: (self.repair(_taken_over(g.takeovers())) if g.takeovers()
                                  else "nothing to repair: the authorities re-announced themselves")
        return inj

    def _wait_counts_settle(self, nodes: Sequence[str], t: float, timeout_s: float = 15.0) -> bool:
        """Until each node's reject total is the same in two reports after ``t``: the node has
        worked through its queue."""
        g = self.g
        end = time.monotonic() + timeout_s
        last: dict[str, tuple[float, str]] = {}
        stable: set[str] = set()
        while time.monotonic() < end and stable != set(nodes):
            for n in nodes:
                dt = g.diag_time(n)
                if dt is None or dt <= t:
                    continue
                total = g.diag(n).get("rejected", "0")
                if n in last and last[n][0] != dt and last[n][1] == total:
                    stable.add(n)
                last[n] = (dt, total)
            time.sleep(0.1)
        return stable == set(nodes)


def _taken_over(lines: Sequence[str]) -> list[str]:
    """The authorities to restart for ChaosGraph.takeovers() lines (coordinator first)."""
    names = []
    if any(not line.startswith("coordinator follows") for line in lines):
        names.append("coordinator")
    if any(line.startswith("coordinator follows") for line in lines):
        names.append("scheduler")
    return names


def _any_effect(effects: Any) -> bool | None:
    """True if any variant had an effect, None if one could not be observed, else False."""
    effects = list(effects)
    return True if any(e is True for e in effects) else (None if any(e is None for e in effects) else False)


def _tbf_bytes(links: Any) -> dict[str, int]:
    """Bytes each end of the emulated link's tbf has sent so far (proof that traffic crosses it)."""
    import re

    out = {}
    for dev, text in links.qdisc_stats().items():
        m = re.search(r"Sent (\d+) bytes", text)
        if m:
            out[dev] = int(m.group(1))
    return out


def run_fault(run: FaultRun, name: str, link_reason: str) -> dict[str, Any]:
    g = run.g
    if name == "kill_compute":
        return run.run(name, run.kill_compute)
    if name in ("kill_scheduler", "kill_coordinator"):
        return run.run(name, lambda: run.kill_authority(name.split("_", 1)[1]))
    if name == "kill_router":
        if g.child("router") is None:
            return skipped(name, "the router runs inside the launcher's own process (no router child to kill)")
        return run.run(name, run.kill_router)
    if name == "flood":
        return run.run(name, run.flood, prepare=run.flood_prepare)
    if name == "link_collapse":
        if g.links is None:
            return skipped(name, link_reason or "no emulated link")
        return run.run(name, run.link_collapse)
    if name.startswith("forge_"):
        kind = name.split("_")[1]
        return run.run(name, lambda: run.forge(kind), prepare=run.attackers)
    if name == "fuzz":
        return run.run(name, run.fuzz, prepare=run.attacker_for)
    raise ValueError(name)
