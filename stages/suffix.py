"""Suffix decoding (Oliaro et al., "SuffixDecoding: Extreme Speculative Decoding for Emerging AI
Applications", 2024, as Arctic Inference implements it for vLLM): drafts from the text a
request and the requests before it have already seen, with no model.

Each request has a suffix tree over its prompt and output; a global one holds the outputs of
recent requests, the running ones' included as they grow. Both are tries of every substring
of at most `depth` tokens, each node counting its substring's occurrences. For each length p
of a suffix of the request's context found in a tree, a draft follows the most frequent
continuation below it while its estimated probability (the product of count(child) /
count(node) along the path) stays at least `min_prob`, for at most p * `spec_factor` tokens
(a long match earns a long draft); the draft with the largest score (its expected number of
accepted tokens: the sum of the probabilities along it) is proposed, the request's own
tree's on a tie, as a chain verified like any host draft.

Trees grow incrementally: a token appended to a text extends the nodes of the text's current
suffixes (at most `depth` of them), so a step costs O(depth) per new token.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from core.request import Request
from core.step import CatchUp, DevicePlan, Drafts, Plan, Sequence, TargetOutput, Verdict
from stages.draft import Drafter, NoDrafter, with_host_drafts


class SuffixTree:
    """Every substring of at most `depth` tokens of the texts added, with its count.

    Nodes are ints: node n's count is counts[n], its children children[n] (token -> node).
    Nothing in them is an object the garbage collector follows (a dict of ints is untracked):
    the global tree full (16,384 tokens' substrings of up to 24, ~390,000 nodes) costs a full
    collection 3 ms, where with a Python object a node it cost 134 ms, a step's host work
    stalled as long (traced on SmolLM2's chats: two plans of 115 ms). A node whose count falls
    to 0 is freed with its subtree and its number reused."""

    ROOT = 0

    def __init__(self, depth: int):
        self.depth = depth
        self.counts: list[int] = [0]
        self.children: list[dict[int, int]] = [{}]
        self.free: list[int] = []  # numbers of freed nodes

    def child(self, node: int, token: int) -> int:
        """The node of node's text followed by token, made where missing."""
        found = self.children[node].get(token)
        if found is not None:
            return found
        if self.free:
            found = self.free.pop()
            self.counts[found], self.children[found] = 0, {}
        else:
            found = len(self.counts)
            self.counts.append(0)
            self.children.append({})
        self.children[node][token] = found
        return found

    def remove(self, ids: list[int]) -> None:
        """Uncount the substrings of a whole text a Cursor added."""
        for start in range(len(ids)):
            node = self.ROOT
            for token in ids[start : start + self.depth]:
                child = self.children[node][token]
                self.counts[child] -= 1
                if self.counts[child] == 0:  # its subtree counts this text alone
                    del self.children[node][token]
                    self._free(child)
                    break
                node = child

    def _free(self, node: int) -> None:
        below = [node]
        while below:
            n = below.pop()
            below.extend(self.children[n].values())
            self.children[n] = {}
            self.free.append(n)

    def find(self, pattern: list[int]) -> int | None:
        node: int | None = self.ROOT
        for token in pattern:
            node = self.children[node].get(token) if node is not None else None
        return node


class Cursor:
    """A text being added to a tree token by token: `active` holds the nodes of the text's
    current suffixes, longest first."""

    def __init__(self, tree: SuffixTree):
        self.tree = tree
        self.length = 0  # tokens added
        self.active: list[int] = []

    def extend(self, ids: list[int]) -> None:
        """Add ids[self.length:] (ids: the whole text so far)."""
        tree, depth = self.tree, self.tree.depth
        for token in ids[self.length :]:
            grown = []
            for node in self.active[-(depth - 1) :] + [tree.ROOT]:
                child = tree.child(node, token)
                tree.counts[child] += 1
                grown.append(child)
            self.active = grown
        self.length = len(ids)


@dataclass
class Draft:
    tokens: list[int]
    score: float  # expected tokens accepted: the sum of the path's probabilities


def draft_from(tree: SuffixTree, node: int, limit: int, min_prob: float) -> Draft:
    """The most frequent path below `node` while its probability is at least min_prob, of at
    most `limit` tokens (a tie goes to the smaller token id)."""
    tokens: list[int] = []
    score, prob = 0.0, 1.0
    counts = tree.counts
    while len(tokens) < limit and tree.children[node]:
        token, child = max(
            tree.children[node].items(), key=lambda item: (counts[item[1]], -item[0])
        )
        prob *= counts[child] / counts[node]
        if prob < min_prob:
            break
        tokens.append(token)
        score += prob
        node = child
    return Draft(tokens, score)


class SuffixDrafter(NoDrafter):
    """Suffix decoding's drafts, proposed on the host at plan time (as n-gram's are)."""

    def __init__(
        self,
        depth: int = 24,
        min_prob: float = 0.1,
        spec_factor: float = 1.0,
        max_tokens: int = 16384,
    ):
        self.depth, self.min_prob, self.spec_factor = depth, min_prob, spec_factor
        # running requests: (the request, its own tree's cursor, its output's in the global)
        self.running: dict[str, tuple[Request, Cursor, Cursor]] = {}
        self.outputs = SuffixTree(depth)  # the outputs of recent and running requests
        self.kept: deque[list[int]] = deque()  # finished requests' outputs there, oldest first
        self.kept_tokens = 0
        self.max_tokens = max_tokens  # the global tree's bound on finished output tokens

    def host_drafts(self, seqs: list[Sequence], k: int) -> list[list[int] | None] | None:
        self.retire()
        return [self.propose_for(s.request, k).tokens for s in seqs]

    def propose_for(self, request: Request, k: int) -> Draft:
        """The request's best draft of at most k tokens (after its tokens so far join the
        trees)."""
        if request.request_id not in self.running:
            own, shared = Cursor(SuffixTree(self.depth)), Cursor(self.outputs)
            self.running[request.request_id] = request, own, shared
        _, own, shared = self.running[request.request_id]
        ids = request.all_ids
        own.extend(ids)
        shared.extend(request.output_ids)
        context = ids[-self.depth :]
        # own tree: the context's suffixes are its active nodes (shortest first here)
        mine = self._best(own.tree, zip(range(1, len(context)), own.active[::-1], strict=False), k)
        theirs = self._best(self.outputs, _matches(self.outputs, context), k)
        return mine if mine.score >= theirs.score else theirs

    def _best(self, tree: SuffixTree, matches: Iterable[tuple[int, int]], k: int) -> Draft:
        """The best-scoring draft below the matches (p, node), shortest first; a tie goes to
        the longer match."""
        best = Draft([], 0.0)
        for p, node in matches:
            limit = min(k, int(p * self.spec_factor + 1e-6))
            draft = draft_from(tree, node, limit, self.min_prob)
            if draft.score >= best.score:
                best = draft
        return best

    def retire(self) -> None:
        """Finished requests leave; their outputs stay in the global tree until the oldest
        pass `max_tokens`."""
        for request_id, (request, _, shared) in list(self.running.items()):
            if request.finish_reason is None:
                continue
            del self.running[request_id]
            output = request.output_ids[: shared.length]  # what the global tree holds
            self.kept.append(output)
            self.kept_tokens += len(output)
            while self.kept_tokens > self.max_tokens:
                oldest = self.kept.popleft()
                self.outputs.remove(oldest)
                self.kept_tokens -= len(oldest)


def _matches(tree: SuffixTree, context: list[int]) -> Iterator[tuple[int, int]]:
    """(p, node) for each suffix of the context of length p < len(context) found in the
    tree, shortest first."""
    for p in range(1, len(context)):
        node = tree.find(context[-p:])
        if node is None:
            return
        yield p, node


class HybridDrafter:
    """Suffix decoding where it expects to pay, a model elsewhere (the draft model, or an EAGLE
    or MTP head, a chain): per step and per request, the suffix draft when its score (expected
    tokens accepted) is at least `min_score`, else the model's. A request may choose either
    half alone (`speculative_method`). The model drafts every row (one batched pass) and the
    host's drafts replace its own in their rows; its prefill and refill run over every
    committed token, whoever drafted it, so its state follows the text either way. A draft
    model skips the refill of a step it drafts no row of, and catches up when it next drafts
    (Drafter.lazy_refill): a step the suffix drafts alone costs the target's forward alone."""

    def __init__(self, head: Drafter, suffix: SuffixDrafter, min_score: float, max_k: int):
        self.head, self.suffix, self.min_score = head, suffix, min_score
        self.max_k = max_k  # a suffix draft's bound: the cost model's k prices the head
        self.target_layers = head.target_layers
        self.leader_only = head.leader_only
        self.lazy_refill = head.lazy_refill
        self.chosen: list[str] | None = None

    def host_drafts(self, seqs: list[Sequence], k: int) -> list[list[int] | None] | None:
        """Each row's suffix draft (up to max_k tokens), or None where the head drafts (k:
        the cost model's choice for the head; at 0 its rows draft nothing)."""
        self.suffix.retire()
        by_head: list[int] | None = None if k else []
        drafts: list[list[int] | None] = []
        for seq in seqs:
            choice = seq.request.params.speculative_method or "hybrid"
            if choice not in ("hybrid", "suffix"):
                drafts.append(by_head)
                continue
            draft = self.suffix.propose_for(seq.request, self.max_k)
            use = choice == "suffix" or draft.score >= self.min_score
            drafts.append(draft.tokens if use else by_head)
        return drafts

    def prefill(self, plan: Plan, dev: DevicePlan, out: TargetOutput, verdict: Verdict) -> None:
        self.head.prefill(plan, dev, out, verdict)

    def propose(self, plan: Plan, dev: DevicePlan) -> Drafts:
        """The head's drafts, the host's in the rows that have them (a host draft is a point
        mass, which a sampled batch's q says row by row)."""
        firsts = plan.fields["host_drafts"][:: plan.k]  # the host's copy: no device read
        if all(token >= 0 for token in firsts):  # the suffix drafted every row
            return Drafts(dev.host_drafts)
        return with_host_drafts(self.head.propose(plan, dev), dev.host_drafts)

    def refill(self, plan: Plan, dev: DevicePlan, out: TargetOutput, verdict: Verdict) -> int:
        return self.head.refill(plan, dev, out, verdict)

    def plan_catch_up(
        self, seqs: list[Sequence], drafting: list[bool], budget: int
    ) -> CatchUp | None:
        return self.head.plan_catch_up(seqs, drafting, budget)

    def probe(self, num_tokens: int) -> None:
        self.head.probe(num_tokens)
