"""The planner's safety net: what the engine delivers under the cost
model's decisions against plain steps alone, measured per load bucket in
blocks of steps, and which of the two decides each next block.

The model decides a bucket's steps only while the steps it drafts for
measure more goodput there than plain; the loser runs a block now and
then, less often the more it loses by (plain, beside a model that leads,
in short probes)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

# The safety net measures what the engine delivers: per load bucket, blocks
# of BLOCK_STEPS steps in a row either decided by the model or all plain,
# each block's goodput the tokens its measured steps generated for
# decoding requests over their seconds (drafting included; of a step with
# prefill chunks, the decoding's share: ``SpecPlanner.observe_step``).
# A step is measured if it decoded, and in a model's block, if the model
# drafted for it: the steps the model itself makes plain are plain steps,
# and hard text, where it makes most of them, must not make speculation
# look like a loss where it pays (nor the steps after the net's plain
# ones, where catching the drafter up is dear). (Counting every step, at
# two requests the net made 24-28% of a DSPARK or DFLASH engine's steps
# plain, against 7-9% so.) But where the model drafted for fewer than
# PROBE_STEPS of a block's steps, the block measures all of them: the
# model keeps choosing plain (a high load), and its blocks must still say
# whether the net's plain steps, without its decisions, do better.
# (Saying nothing, at 16 requests from a fresh start, the net made 1% of
# a DFLASH engine's steps plain, which ran 0.946x plain; measured, 94%,
# 0.988x.) A block with fewer than PROBE_STEPS steps measured either way
# says nothing. Each of the model's blocks gives a ratio, its goodput over
# plain's measured around it (the plain blocks before and after it); the
# median of a bucket's last NET_RECENT ratios decides (of those, its
# explorations and the recent ones: NET_WINDOW). The model keeps a bucket
# only while it leads by NET_MARGIN (a tie goes plain: speculation must not
# cost throughput).
# The loser runs one block every `wait` blocks, `wait` set so that
# exploring costs about EXPLORE_LOSS of the winner's goodput: a loser that
# loses by 20% waits 20 of the winner's blocks if its block takes as long
# as one of them, 5 if a quarter of the time (a plain probe: a quarter of
# the steps), 60 if three times (a model block at a high load), within
# [EXPLORE_MIN, EXPLORE_MAX] and growing at most fourfold per exploration
# (back to EXPLORE_MIN after one that contradicts the verdict).
# The model runs the first block, plain the second, and so on until
# FIRST_PAIRS of the model's blocks are measured, unless a neighbouring
# bucket's verdict holds here (``SafetyNet._neighbours_lead``).
# A block that follows one of the other regime first runs SETTLE_STEPS
# steps it does not measure: the switch's cost belongs to neither regime's
# steady state. (At 8 requests the first plain step after drafted steps
# ran 8-25% over the plain steps after it, three runs offline: a 4-step
# probe measured plain 2-6% low, in the model's favour. The model's first
# step after plain ones pays the drafter's catch-up of them.)
BLOCK_STEPS = 16
SETTLE_STEPS = 1
# Plain measured beside a model that leads (or is not judged yet) runs
# this many steps, a probe: a plain step's goodput depends on neither the
# text nor a drafter's state (once settled), so a few steps measure it,
# and at low load each costs what speculation gains (at one client, whole
# plain blocks were 3 of a wave's first 16 blocks: about 10% of a 1.4x
# lead). The model's blocks stay whole: its goodput goes with the text.
PROBE_STEPS = 4
# The model's blocks whose ratios decide: a stretch of hard text (one
# request's, at one or two requests) must not outvote the text around it.
# (At one request a block's ratio scattered over 1.1-2.3 around a lead
# of 1.5 with the text, on a quiet machine; a hard request's blocks ran
# 0.7-0.9. Counted only next to a probe, the last 5 ratios' median fell
# below the margin now and then: a 1-request DSPARK engine was plain in
# 38% of its steps, 1.17x plain where its fixed length ran 1.41x. Every
# block counted, by the median of the last 7 the net still made 23% of
# 2,300 steps plain; of the last 15, 6%.)
NET_RECENT = 15
# ... and of those, the explorations (run while plain held the bucket),
# however old, and of the blocks the model ran as the winner only those
# that ended within the bucket's last NET_WINDOW steps (about what
# NET_RECENT of them span), the latest FIRST_PAIRS always: the hard text
# that gave plain the bucket must not outvote the explorations after it
# for the NET_RECENT blocks it took to turn the verdict. (At one request,
# DFLASH engines whose text turned hard for a stretch stayed plain for 530
# steps after it, 8 explorations later: 1.05-1.21x plain where the same
# engines without the net ran 1.24-1.26x.) But explorations are few and
# far apart, and by the latest few alone a losing model took back a
# 64-request bucket by chance: 0.90x plain against 0.94x, DSPARK.
NET_WINDOW = 256
# A bucket's first verdict waits for this many of the model's blocks (the
# model's blocks and plain's probes alternating until then; a neighbour's
# verdict stands in as one vote): a first verdict against the leader held
# for blocks (a sweep's 1-client DSPARK server, its model ahead, stepped
# plain 76% of the time).
FIRST_PAIRS = 3
NET_MARGIN = 0.05
EXPLORE_LOSS = 0.01
EXPLORE_MIN, EXPLORE_MAX = 4, 64


def load_bucket(n: int) -> int:
    """The safety net's load bucket: 1, 2, 3-4, 5-8, ... (a load of C
    clients and the C - 1 left while one is replaced share one)."""
    return max(n - 1, 0).bit_length()


MODEL, PLAIN = "model", "plain"


@dataclass
class ModelBlock:
    """A model's block measured: its goodput, and plain's measured nearest it
    in time, before and after (None: not yet)."""

    goodput: float
    before: float | None
    at: int = 0  # the bucket's steps when it ended
    explored: bool = False  # run while plain held the bucket (an exploration)
    after: float | None = None

    @property
    def ratio(self) -> float | None:
        """Its goodput over plain's around it (the mean of the two sides: the
        machine's drift between them cancels to first order)."""
        sides = [p for p in (self.before, self.after) if p is not None]
        return self.goodput / max(sum(sides) / len(sides), 1e-12) if sides else None


@dataclass
class BucketNet:
    """One load bucket's measurements and which regime its next block runs.

    Each of the model's blocks is measured against plain's goodput around it
    in time (its latest probes before the block and after it): the bucket
    keeps its last NET_RECENT model blocks and goes by the median of the
    ratios of those that still count (``ratios``). Plain around each block
    shares the machine's state, which drifts by more than the differences
    judged (another process, a slower clock: 10-25% over minutes on a
    shared 2-core machine), every model block counts (not only those next
    to a probe: the text makes one block's goodput scatter by a factor of
    two at one request), and a median ignores a stalled block."""

    blocks: list[ModelBlock] = field(default_factory=list)  # the model's latest
    # A neighbouring bucket's lead, standing in until measured here.
    prior: float | None = None
    explored: int = 0  # the loser's blocks since the verdict (or one contradicting it)
    last: str | None = None  # the regime of the bucket's last block
    countdown: int | None = None  # the winner's blocks before the loser's next one
    # Plain's latest blocks: goodput, steps, the bucket's steps when it ended.
    plain: list[tuple[float, int, int]] = field(default_factory=list)
    steps: int = 0  # the bucket's steps so far (its blocks', measured or not)
    # Each regime's seconds per measured step, in its latest block.
    step_seconds: dict[str, float] = field(default_factory=dict)

    def add(self, regime: str, goodput: float, steps: int, seconds: float) -> None:
        """A block's goodput over its ``steps`` (``seconds`` in all)."""
        self.step_seconds[regime] = seconds / max(steps, 1)
        verdict = self.winner() if self.measured else None
        if regime == PLAIN:
            latest = (goodput, steps, self.steps)
            self.plain = [*self.plain[1 - BLOCK_STEPS // PROBE_STEPS :], latest]
            around = self.plain_goodput()
            for block in reversed(self.blocks):  # those since plain's last block
                if block.after is not None:
                    break
                block.after = around
        else:
            before = self.plain_goodput() if self.plain else None
            explored = self.judged and self.winner() == PLAIN
            block = ModelBlock(goodput, before, self.steps, explored)
            self.blocks = [*self.blocks[1 - NET_RECENT :], block]
        self.last = regime
        # The loser's block said the verdict is wrong (a model's block ahead
        # by the margin where plain won; a probe that puts the model's last
        # block behind where the model won): the next exploration comes at
        # the shortest wait, not a longer one. (At one request, hard text
        # gave plain the bucket; the model's next explorations ran 1.6-2x
        # plain, but the waits grew fourfold each and the text's blocks
        # outvoted them in the median for hundreds of steps.)
        newest = self.blocks[-1].ratio if self.blocks else None
        contradicts = newest is not None and (newest > 1 + NET_MARGIN) == (verdict == PLAIN)
        if verdict is not None and regime != verdict and contradicts:
            self.explored = 0

    def plain_goodput(self) -> float:
        """Plain's goodput now: the median of its latest blocks within a whole
        block's steps (a probe is a few steps, each as noisy as a step on a
        busy machine, and one stalled probe is outvoted), of those within
        the last NET_WINDOW steps (the latest two always, the higher
        counting: one stalled probe still outvoted): probes far apart
        measured another machine. (Probes stalled by another process's
        burst, then rare behind a model that seemed to lead by 4-12x, were
        the reference of its blocks for 400 steps.)"""
        recent, total = [], 0
        for g, n, at in reversed(self.plain):
            if len(recent) >= 2 and self.steps - at >= NET_WINDOW:
                break
            recent.append(g)
            total += n
            if total >= BLOCK_STEPS:
                break
        return statistics.median_high(recent)  # an even split: the higher

    @property
    def ratios(self) -> list[float]:
        """The model's latest blocks' goodput over plain's around them: its
        explorations, and of the blocks it ran as the winner those within the
        last NET_WINDOW steps; the latest FIRST_PAIRS at least."""
        rated = [(b, r) for b in self.blocks if (r := b.ratio) is not None]
        recent = [r for b, r in rated if b.explored or self.steps - b.at < NET_WINDOW]
        if len(recent) >= FIRST_PAIRS:
            return recent
        return [r for _, r in rated[-FIRST_PAIRS:]]

    @property
    def lead(self) -> float:
        """The model's goodput over plain's: the median of the recent ratios,
        the prior one of them while they are fewer than FIRST_PAIRS (before
        any: the prior, else 1)."""
        votes = self.ratios
        if len(votes) < FIRST_PAIRS and self.prior is not None:
            votes.append(self.prior)
        return statistics.median(votes) if votes else 1.0

    def winner(self) -> str:
        return MODEL if self.lead > 1 + NET_MARGIN else PLAIN

    def next_regime(self) -> str:
        """The regime of the bucket's next block."""
        if not self.judged:  # the model first, then plain beside it
            return PLAIN if self.last == MODEL else MODEL
        leader = self.winner()
        if self.countdown is None:  # armed from the gap as measured now
            lead = self.lead
            gap = max(lead, 1 / max(lead, 1e-12)) - 1
            # A long wait needs several explorations: it grows at most
            # fourfold per exploration (one slow block must not condemn a
            # regime for long; the median of a few blocks outvotes it). At a
            # high load, twofold explored a losing model for a fifth of a
            # 32-client wave's time.
            known = EXPLORE_MIN << 2 * self.explored
            wait = min(round(gap * self._share(leader) / EXPLORE_LOSS), known, EXPLORE_MAX)
            self.countdown = max(wait, EXPLORE_MIN)
        if self.countdown > 0:
            self.countdown -= 1
            return leader
        self.countdown = None
        if self.measured:  # (a neighbour's verdict is explored at the shortest wait)
            self.explored += 1
        return PLAIN if leader == MODEL else MODEL

    def _share(self, leader: str) -> float:
        """The loser's block's time over the leader's: what one exploration
        costs in the leader's blocks (at a high load a model's step takes
        several plain ones' time; by steps alone, exploring it cost a
        32-client wave about a quarter of its time)."""
        loser = MODEL if leader == PLAIN else PLAIN
        share = self.block_steps(loser) / BLOCK_STEPS
        if loser in self.step_seconds and self.step_seconds.get(leader):
            share *= self.step_seconds[loser] / self.step_seconds[leader]
        return share

    def block_steps(self, regime: str) -> int:
        """The steps of a block of ``regime``: a probe for plain beside a model
        that leads or is not judged yet."""
        probe = regime == PLAIN and (not self.judged or self.winner() == MODEL)
        return PROBE_STEPS if probe else BLOCK_STEPS

    @property
    def judged(self) -> bool:
        """Whether a lead is known: measured here, or a neighbour's."""
        return self.measured or self.prior is not None

    @property
    def measured(self) -> bool:
        """Whether its own ratios decide (FIRST_PAIRS of them)."""
        return len(self.ratios) >= FIRST_PAIRS


@dataclass
class Tally:
    """Steps measured: their tokens (rounds at their credit) and seconds."""

    steps: int = 0
    tokens: float = 0.0
    seconds: float = 0.0

    def add(self, tokens: float, seconds: float) -> None:
        self.steps += 1
        self.tokens += tokens
        self.seconds += seconds


@dataclass
class Block:
    """The steps in a row that one regime decides, and what they measured."""

    net: BucketNet
    regime: str
    length: int  # its steps in all
    settle: int = 0  # its first steps, not measured (SETTLE_STEPS)
    steps: int = 0
    drafted: Tally = field(default_factory=Tally)  # plain's steps, or the model's drafted
    every: Tally = field(default_factory=Tally)  # every step after the settling

    def measured(self) -> Tally | None:
        """What the block measured (see BLOCK_STEPS); None: too little."""
        if self.drafted.steps >= PROBE_STEPS:
            return self.drafted
        return self.every if self.every.steps >= PROBE_STEPS else None


class SafetyNet:
    """Every load bucket's net, and the block of steps in progress."""

    def __init__(self) -> None:
        self.nets: dict[int, BucketNet] = {}  # by load_bucket
        self.block: Block | None = None  # the steps the current regime decides

    def regime(self, requests: int) -> str:
        """Who decides the next step (at ``requests`` running): the block in
        progress's regime, or a new block's, its bucket's choice."""
        block = self.block
        if block is None or block.steps >= block.length:
            if block is not None:
                block.net.steps += block.steps
                tally = block.measured()
                if tally is not None:
                    goodput = tally.tokens / max(tally.seconds, 1e-12)
                    block.net.add(block.regime, goodput, tally.steps, tally.seconds)
            b = load_bucket(requests)
            net = self.nets.get(b)
            if net is None:
                net = self.nets[b] = BucketNet(prior=self._neighbours_lead(b))
            regime = net.next_regime()
            settle = SETTLE_STEPS if block is not None and block.regime != regime else 0
            block = self.block = Block(net, regime, net.block_steps(regime) + settle, settle)
        return block.regime

    def _neighbours_lead(self, b: int) -> float | None:
        """A new bucket's prior: speculation gains less the more requests share
        a step, so plain winning at a lighter load, or the model at a heavier
        one, says the same here until measured (None: neither did)."""
        judged = sorted(k for k, net in self.nets.items() if net.measured)
        lower = [k for k in judged if k < b]
        if lower and self.nets[lower[-1]].winner() == PLAIN:
            return self.nets[lower[-1]].lead
        higher = [k for k in judged if k > b]
        if higher and self.nets[higher[0]].winner() == MODEL:
            return self.nets[higher[0]].lead
        return None

    def observe(self, tokens: float, seconds: float, drafted: bool) -> None:
        """A decoding step of the block in progress: its tokens (each verify
        round at its credit) and seconds (its drafting and decisions
        included); ``drafted``: whether the drafter ran for it. The regime's
        cost is all of it but the switch's (a block's settling steps) and
        the prefill chunks' beside (the planner passes the decoding's
        share)."""
        block = self.block
        if block is None:
            return
        block.steps += 1
        if block.steps > block.settle:
            block.every.add(tokens, seconds)
            if drafted or block.regime == PLAIN:
                block.drafted.add(tokens, seconds)
