"""What runs each step and each graph: the one module that decides.

Per compiled model, :class:`Runtime` walks the ladder (``runtime.executors``) for every
Dynamo graph, queues the builds that can win, hands each finished contender to the judge
(``runtime.judge``) and runs the judge's choice. In order, for an input signature:

1. **First step**: the graphs are captured and run on their captured runner (``plan``: each
   graph profiled, planned and generated at its first call). Each Dynamo graph's verdict is
   looked up in the decision cache (``runtime.decisions``); a graph remembered with a
   winner other than ``plan`` is not profiled.
2. **Second step**: the ladder walk. If every graph of the signature remembers the same
   winner, that is the verdict, with no race, and only the winner is built (here, at once:
   Inductor's cache makes it a hit). Otherwise ``eager`` and ``plan`` enter the race, and
   each executor that builds is asked whether it can run each graph and can win there
   (``why_not``: its rules, the profile, a verdict it lost before); those that can wait for
   the first verdict, then compile in the background (``runtime.builds``) while the steps
   run that verdict: no step the judge times runs beside a compile, which slowed the
   planned programs' OpenMP teams by half on the 2-core box even at idle priority.
3. **Later steps**: once every build of the signature has finished, the executors built
   (for every graph they can run; the others keep their captured runner) race the verdict;
   the judge picks each step's contender until its new verdict. A verdict given with
   nothing left to build is remembered for the next run; a re-plan on drift
   (``adapt.monitor``) races again.

A build compiles in the background at idle priority (``codegen.warmup``); a graph whose
executor was compiled here before (the decision cache says so) compiles it at once, a hit
in Inductor's cache. The training thread never sleeps for a build: lending a busy 2-core
box's time to a cold compile made every step slower for longer than the first minute, and
the compile still did not finish in it. ``background=False`` builds every contender at the
second step.

Example::

    >>> rt = Runtime(("eager", "plan"), background=True, decisions=Decisions(None))
    >>> rt.step("k", now=0.0)        # the first step of a signature compiles
    'plan'
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from autopar.codegen.inductor import input_meta, stand_ins
from autopar.codegen.joint import roles, with_roles
from autopar.runtime.builds import Build, Builds
from autopar.runtime.decisions import Decisions, graph_key
from autopar.runtime.executors import TABLE
from autopar.runtime.judge import Judge

log = logging.getLogger("autopar")


@dataclass
class GraphState:
    """One Dynamo graph: its signature, its inputs' metadata, and each executor's status."""

    graph: Any  # the capture.DynamoGraph
    key: object
    meta: list
    roles: list
    decision_key: str
    remembered: str | None  # the decision cache's winner, if any
    warm: frozenset = frozenset()  # executors compiled for it here before: cache hits now
    status: dict[str, str] = field(default_factory=dict)  # executor -> what became of it
    programs: dict[str, Any] = field(default_factory=dict)  # executor -> built program

    def args(self) -> list:
        return with_roles(stand_ins(self.meta), self.roles)


@dataclass
class _Signature:
    graphs: list[GraphState] = field(default_factory=list)
    walked: bool = False
    remembered: bool = False  # the verdict came from the decision cache
    said: str | None = None  # the verdict last told
    stored: bool = False  # its final verdict is in the decision cache
    waiting: list = field(default_factory=list)  # builds held until the first verdict


class Runtime:
    """One compiled model's decisions (module docstring)."""

    def __init__(self, ladder: tuple[str, ...], background: bool, decisions: Decisions,
                 records_of=lambda group: [], describe=str) -> None:  # fmt: skip
        self.ladder = ladder
        self.describe = describe  # an input signature in words
        self.judge = Judge()
        self.builds = Builds(background)
        self.decisions = decisions
        self.records_of = records_of  # Dynamo graph k -> its recorded aten graphs
        self.events: list[str] = []  # one line per build and verdict
        self._graphs: dict[int, GraphState] = {}
        self._keys: dict[object, _Signature] = {}
        self._compiled = False  # this step compiled a build here (``step``, ``_finished``)

    # -- the step ---------------------------------------------------------------------------
    def step(self, key, now: float) -> str:
        """A step of signature ``key`` starts ``now``: what runs it (an executor's name)."""
        self._compiled = False  # set by _finished: a build compiled (or failed) here
        for b in self.builds.poll(key):
            self._finished(b)
        sig = self._keys.get(key)
        if sig is None:  # its first step: capture (and the graphs' first calls)
            self._keys[key] = _Signature()
            self._void_open_steps()
            return "plan"
        if not sig.walked and sig.graphs:
            self._walk(key, sig)  # may compile here (a remembered or cached build)
        if self._compiled:
            self._void_open_steps()
        verdict = self.judge.verdict(key)
        alone = self.judge.contenders(key)
        if verdict is None and len(alone) == 1 and sig.walked and not self.builds.pending(key):
            verdict = alone[0]  # nothing to race it against, nothing left to build
            self.judge.settle(key, verdict, f"{verdict}: the only executor that can run it")
            sig.said, sig.stored = verdict, True  # said, not measured: nothing to remember
        who = self.judge.choose(key, now)  # may give the verdict
        if self._compiled:  # this step began with a compile here: not the executor's time
            self.judge.dirty(key)
        verdict = self.judge.verdict(key)
        if sig.waiting and (verdict is not None or len(self.judge.contenders(key)) < 2):
            for b in sig.waiting:  # the steps run the verdict while they compile
                self.builds.add(b)
            sig.waiting = []
        if verdict is not None and verdict != sig.said and not sig.remembered:
            sig.said = verdict
            self._event(f"steps {self.describe(key)}: {self.judge.report()[key][1]}")
        if (verdict is not None and not sig.stored and not sig.remembered
                and not sig.waiting and not self.builds.pending(key)):  # final: all raced
            sig.stored = True
            medians = self.judge.medians(key)
            for gs in sig.graphs:
                self.decisions.put(gs.decision_key, verdict, medians)
        return who or "plan"

    def reopen(self, group: int, why: str):
        """Dynamo graph ``group``'s program changed under its verdict (the monitor re-planned
        it on sustained drift): its signature races again. Returns that signature, or None."""
        gs = next((g for g in self._graphs.values() if g.graph.group == group), None)
        if gs is None or self.judge.verdict(gs.key) is None:
            return None
        self.judge.reopen(gs.key, why)
        self._keys[gs.key].said, self._keys[gs.key].stored = None, False
        self._event(f"steps {self.describe(gs.key)}: racing again: {why}")
        return gs.key

    def graph_seen(self, graph, args: list, key) -> None:
        """The first call of Dynamo graph ``graph`` (in a step of signature ``key``)."""
        dkey = graph_key(graph.gm, args, self.ladder, key)
        rec = self.decisions.get(dkey) or {}
        gs = GraphState(graph, key, input_meta(args), roles(args), dkey, rec.get("winner"),
                        frozenset(rec.get("built", ())))  # fmt: skip
        self._graphs[id(graph)] = gs
        self._keys.setdefault(key, _Signature()).graphs.append(gs)
        self.judge.dirty(key)

    def graph_state(self, graph) -> GraphState | None:
        """What the runtime knows of Dynamo graph ``graph`` (None: not called yet)."""
        return self._graphs.get(id(graph))

    def profiles(self, group: int) -> bool:
        """Whether the recorded graphs of Dynamo graph ``group`` are profiled and planned at
        their first call: ``plan`` is on the ladder and no verdict other than ``plan`` is
        remembered for the graph."""
        gs = next((g for g in self._graphs.values() if g.graph.group == group), None)
        remembered = gs.remembered if gs is not None else None
        return "plan" in self.ladder and remembered in (None, "plan")

    def program(self, graph, name: str | None):
        """What runs ``graph`` in a step of executor ``name``: its built program, else the
        captured runner (``plan``'s)."""
        gs = self._graphs.get(id(graph))
        prog = gs.programs.get(name) if gs is not None and name else None
        return prog.fn if prog is not None else graph.captured

    def reject(self, graph, name: str, why: str) -> None:
        """``name``'s program failed its first call on ``graph``: it leaves every race."""
        gs = self._graphs.get(id(graph))
        if gs is not None:
            gs.programs.pop(name, None)
            gs.status[name] = f"left the race: its first call {why}"
            self.judge.remove(gs.key, name, why)
        self._event(f"{graph.tag}: {name} left the race: its first call {why}")
        if gs is not None:
            self._unremember(gs.key, name)

    def settled(self, key=None) -> bool:
        """Nothing left to build or race (for ``key``, or every signature)."""
        keys = [key] if key is not None else list(self._keys)
        return not self.builds.pending(key) and all(
            k in self._keys and self._keys[k].walked and not self._keys[k].waiting and (
                self.judge.verdict(k) is not None or len(self.judge.contenders(k)) < 2)
            for k in keys)  # fmt: skip

    # -- the ladder walk ----------------------------------------------------------------------
    def _walk(self, key, sig: _Signature) -> None:
        sig.walked = True
        wins = {gs.remembered for gs in sig.graphs}
        if len(wins) == 1 and None not in wins and next(iter(wins)) in self.ladder:
            won = wins.pop()
            sig.remembered = True
            self.judge.settle(key, won, f"{won}: remembered from an earlier run on this "
                                        "machine (decision cache); no race")  # fmt: skip
            for gs in sig.graphs:
                for name in self.ladder:
                    gs.status[name] = "winner (remembered)" if name == won else "not built: " \
                        f"{won} won here before"
            self._queue(key, sig, only=won, now=True)
            return
        for name in ("eager", "plan"):
            if name in self.ladder:
                self.judge.enter(key, name)
                for gs in sig.graphs:
                    gs.status[name] = "racing"
        self._queue(key, sig)

    def _queue(self, key, sig: _Signature, only: str | None = None, now: bool = False) -> None:
        for name in self.ladder:
            ex = TABLE[name]
            if not ex.builds or (only is not None and name != only):
                continue
            for gs in sig.graphs:
                records = self.records_of(gs.graph.group)
                profile = [r.table for r in records]
                args = gs.args()
                if gs.status.get(name, "").startswith(("failed", "left", "not offered")):
                    continue  # a remembered winner that could not run: not again
                lost = gs.remembered is not None and gs.remembered != name
                why = (f"lost to {gs.remembered} here before (decision cache)" if lost
                       else _why_not(ex, gs.graph, args, records, profile))  # fmt: skip
                if why is not None:
                    gs.status[name] = f"not offered: {why}"
                    if only is not None:  # the remembered winner cannot run here now
                        self._unremember(key, name)
                        return
                    continue
                warm, build = ex.parts(gs.graph, args, profile)
                cold = ex.cost_s * len(gs.graph.gm.graph.nodes)
                here = now or name in gs.warm  # compiled here before: a cache hit, at once
                gs.status[name] = ("compiling here (Inductor's cache holds it)" if here else
                                   f"compiling after the first verdict, in the background "
                                   f"(cold: about {cold:.0f} s of a core)")  # fmt: skip
                b = Build(gs.graph, name, key, None if here else warm, build)
                if here or not self.builds.background:
                    self.builds.add(b)
                else:  # compiled after the first verdict (``step``): no race beside a compile
                    sig.waiting.append(b)
        for b in self.builds.poll(key):
            self._finished(b)
        self._enter_complete(key, sig)

    def _finished(self, b: Build) -> None:
        gs = self._graphs.get(id(b.graph))
        if gs is None:
            return
        self._compiled = True
        if b.error is not None:
            gs.status[b.name] = f"failed: {b.error}"
            self._event(f"{b.graph.tag}: {b.name} could not be built ({b.error})")
            self._unremember(b.key, b.name)
        else:
            gs.programs[b.name] = b.program
            gs.status[b.name] = f"built (compiled here in {b.seconds:.1f} s)"
            self._event(f"{b.graph.tag}: {b.name} built")
            self.decisions.put(gs.decision_key, built=(b.name,))
        sig = self._keys.get(b.key)
        if sig is not None:
            self._enter_complete(b.key, sig)

    def _enter_complete(self, key, sig: _Signature) -> None:
        """Each executor whose builds have finished for every graph of ``key`` (one at least
        built) enters ``key``'s race (or, remembered, runs); racing waits until no build of
        ``key`` compiles any more, so that no step is timed beside a compile."""
        if not sig.remembered and (sig.waiting or self.builds.pending(key)):
            return
        for name in self.ladder:
            if not TABLE[name].builds or name in self.judge.contenders(key):
                continue
            done = [gs.status.get(name, "").startswith(("built", "not offered", "failed",
                                                        "left", "not built"))
                    for gs in sig.graphs]  # fmt: skip
            built = any(name in gs.programs for gs in sig.graphs)
            if all(done) and built:
                if sig.remembered:
                    self.judge.settle(key, name, self.judge.report()[key][1])
                else:
                    self.judge.enter(key, name)
                for gs in sig.graphs:
                    if name in gs.programs:
                        gs.status[name] = gs.status[name] + "; racing"

    def _void_open_steps(self) -> None:
        """A capture or a compile ran here: the open step of every signature holds it, so
        none of them counts (plain steps of signatures that take turns do count: they hold
        each other alike for every contender)."""
        for k in self._keys:
            self.judge.dirty(k)

    def _unremember(self, key, name: str) -> None:
        """The remembered winner ``name`` of ``key`` cannot run here now (not offered, not
        built, or its first call failed): forget it, and walk the whole ladder at the next
        step (``plan`` then runs its graphs as captured: they were not profiled)."""
        sig = self._keys.get(key)
        if sig is None or not sig.remembered:
            return
        sig.remembered, sig.walked, sig.said = False, False, None
        for gs in sig.graphs:  # what became of name stays: it is not offered again
            gs.remembered, gs.warm = None, gs.warm - {name}
            gs.status = {name: gs.status[name]} if name in gs.status else {}
        self.judge.forget(key)
        self._event(f"steps {self.describe(key)}: the remembered winner {name} cannot run "
                    "here now; racing the ladder")  # fmt: skip

    def _event(self, line: str) -> None:
        self.events.append(line)
        log.info("autopar: %s", line)


def _why_not(ex, graph, args, records, profile) -> str | None:
    try:
        return ex.why_not(graph, args, records, profile)
    except Exception as exc:  # noqa: BLE001 - a rule that cannot decide: not offered
        return f"{type(exc).__name__}: {exc}"
