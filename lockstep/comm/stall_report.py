"""Why a collective does not finish: who has not reached it, who issued something else, and
what each of those ranks is doing now. Used by the watchdog's warning and by the error when
the timeout fires, so both say the same thing.

Every rank publishes its last few numbered collectives per group (watchdog.py); this module
reads them, compares them with this rank's own ledger and renders the verdict. The
judgement is a pure function of what was published, tested without processes.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field

import torch.distributed as dist

from lockstep.comm import stacks
from lockstep.comm.diagnostics import _read_progress
from lockstep.comm.ledger import HISTORY, Entry, Record, ledger, mismatches

LEDGER_KEY = "lockstep/collectives/"  # + rank: JSON {group: [[seq, step, label], ...]}
STACK_WAIT_S = 2.0  # how long to wait for the ranks asked for their stacks


@dataclass
class Judgement:
    """What the published ledgers say about one unfinished collective."""

    late: list[int] = field(default_factory=list)
    """Ranks of the group that have not issued it yet (or never published anything)."""
    desync: tuple[int, dict[int, Entry]] | None = None
    """(number, each rank's collective at that number) where ranks issued different ones."""
    odd: list[int] = field(default_factory=list)
    """The ranks that issued something other than most ranks (both sides of a tie)."""

    @property
    def culprits(self) -> list[int]:
        return self.odd if self.desync is not None else self.late


def judge(seq: int | None, partner: int | None, members: list[int], me: int,
          mine: list[Entry], published: dict[int, list[Entry]]) -> Judgement:
    """Compare this rank's collectives (`mine`, up to number `seq` or later) with what each
    other member of the group published (`published`: its last few, by rank). `seq` None:
    a send or receive with `partner`, which only that rank can be holding up."""
    others = [r for r in members if r != me]
    if seq is None:
        return Judgement(late=[partner] if partner is not None else [])
    late = [r for r in others if not published.get(r) or published[r][-1][0] < seq]
    differ = {n for r in others for n in mismatches(mine, published.get(r, []))}
    if not differ:
        return Judgement(late=late)
    everyone = {**published, me: mine}
    # Judge at the number most ranks still show, so that the majority can be told.
    entries = {n: {r: e for r, known in everyone.items() for e in known if e[0] == n}
               for n in differ}
    first = min(differ, key=lambda n: (-len(entries[n]), n))
    at = entries[first]
    counts = Counter(at.values()).most_common()
    tie = len(counts) > 1 and counts[0][1] == counts[1][1]
    odd = sorted(at) if tie else sorted(r for r, e in at.items() if e != counts[0][0])
    return Judgement(late=late, desync=(first, at), odd=odd)


def read_published(store: dist.Store, ranks: list[int], group: str) -> dict[int, list[Entry]]:
    """The last collectives each rank published for `group` (ranks that published none are
    left out)."""
    found: dict[int, list[Entry]] = {}
    for rank in ranks:
        key = f"{LEDGER_KEY}{rank}"
        try:
            if store.check([key]):
                entries = json.loads(store.get(key))["groups"].get(group)
                if entries:
                    found[rank] = [(int(s), int(t), str(label)) for s, t, label in entries]
        except Exception:  # advisory: a rank's half-written or odd record is skipped
            continue
    return found


def _where(members: list[int]) -> str:
    return "" if members == list(range(dist.get_world_size())) else f" among ranks {members}"


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8])
    more = f" and {len(ranks) - 8} more" if len(ranks) > 8 else ""
    return f"rank {shown}" if len(ranks) == 1 else f"ranks {shown}{more}"


def verdict(judgement: Judgement, silent: list[int], exited: list[int]) -> str:
    """One line: the cause, as far as the ledgers tell. `silent`: culprits that did not
    answer a request for their stack; `exited`: those that have left."""
    if judgement.desync is not None:
        seq, at = judgement.desync
        sides: dict[Entry, list[int]] = {}
        for rank, entry in sorted(at.items()):
            sides.setdefault(entry, []).append(rank)
        said = "; ".join(f'{_ranks(r)} issued "{e[2]}" in step {e[1]}' for e, r in sides.items())
        odd = judgement.odd
        return (f"desync at collective #{seq}: {said}. {_ranks(odd)} "
                f"{'is' if len(odd) == 1 else 'are'} out of step (a skipped or extra backward, "
                "or a collective only some ranks call)")
    if judgement.late:
        gone = [r for r in judgement.late if r in exited]
        stopped = [r for r in judgement.late if r in silent]
        behind = [r for r in judgement.late if r not in gone and r not in stopped]
        parts = [f"{_ranks(gone)} exited without reaching it"] if gone else []
        answer = "does not answer" if len(stopped) == 1 else "do not answer"
        parts += [f"{_ranks(stopped)} did not reach it and {answer} (stopped?)"] \
            if stopped else []
        parts += [f"{_ranks(behind)} did not reach it"] if behind else []
        return "; ".join(parts)
    return ("every rank has issued it, yet it does not finish: the transport is stuck "
            "(network, or a device that makes no progress)")


def describe_rank(rank: int, progress: tuple[int, str, float] | None,
                  published: list[Entry] | None, stack: str | None, asked: bool) -> str:
    """Lines on one rank: its progress, its last collective, and its stack now."""
    parts = [f"  rank {rank}:"]
    if progress is not None:  # the stamp is when it reached that step (or exited)
        step, state, stamp = progress
        since = f"{max(0.0, time.time() - stamp):.1f}s"
        parts.append(f"exited at step {step}, {since} ago;" if state == "exited" else
                     f"in step {step} for {since};")
    else:
        parts.append("no progress reported;")
    if published:
        seq, step, label = published[-1]
        parts.append(f'its last collective #{seq} "{label}" (step {step})')
    else:
        parts.append("no collective of this group issued")
    line = " ".join(parts)
    if stack is not None:
        indented = "\n".join(f"    {text}" for text in stack.splitlines())
        return f"{line}; it is now at:\n{indented}"
    if asked:
        return (f"{line}; no answer to a request for its stack: stopped (SIGSTOP?), or "
                "stuck in native code that holds the GIL")
    return line


@dataclass
class Diagnosis:
    collective: str
    """Which collective: its number, label and step."""
    verdict: str
    """One line: who holds it up, or the desync."""
    details: str
    """A line per culprit: its progress, last collective and (if asked) its stack."""
    culprits: list[int]


def diagnose(store: dist.Store, record: Record, with_stacks: bool) -> Diagnosis:
    """Read what every member of the record's group published, judge, and (optionally) ask
    the culprits for their stacks."""
    me, members = dist.get_rank(), ledger.members.get(record.group, [])
    published = read_published(store, [r for r in members if r != me], record.group)
    mine = ledger.recent(record.group, HISTORY)
    judgement = judge(record.seq, record.partner, members, me, mine, published)
    progress = _read_progress(dist.get_world_size())
    exited = [r for r in judgement.culprits if progress.get(r, (0, "", 0.0))[1] == "exited"]
    ask = [r for r in judgement.culprits if r not in exited and r != me] if with_stacks else []
    answers = stacks.request(store, ask, STACK_WAIT_S) if ask else {}
    published[me] = mine  # a desync's tie may name this rank too
    lines = [describe_rank(r, progress.get(r), published.get(r), answers.get(r), r in ask)
             for r in judgement.culprits]
    silent = [r for r in ask if r not in answers]
    return Diagnosis(f"{record.name()} of step {record.step}{_where(members)}",
                     verdict(judgement, silent, exited), "\n".join(lines), judgement.culprits)
