"""Tree drafting: the head drafts a tree of candidates level by level, of a fixed shape
(FixedTree: paths of child ranks, Medusa / EAGLE style) or the dynamic EAGLE-2 tree
(DynamicTree), and the target verifies the whole tree in one forward (stages/tree.py: its
ancestry and masks, the accepted path's KV move).

A shape is pure: its `grow` is a generator that yields each Expansion (the nodes
the head must run next) and is sent the head's output for them, and returns the DraftedTree.
It never touches the head, its cache or the step's attention; TreeDrafter runs the head.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch

from core.attention_metadata import AttentionMetadata, SharedKeys, TreeKeys
from core.params import SamplingTensors
from core.step import DevicePlan, Drafts, Plan, TargetOutput, Verdict
from kv.cache import KVCache
from models.attention import AttentionBackend
from models.graphs import Forward
from stages.draft import grammar_masked, refill_columns
from stages.grammar import GrammarWalk
from stages.head_drafter import Head, HeadDrafter
from stages.logits import process_logits
from stages.rng import SALT_CHILD, coupling_noise, uniforms
from stages.sampling import draw
from stages.tree import move_tree_path, tree_ancestors, tree_drafts


class TreeDrafter(HeadDrafter):
    """A head drafter over a tree of candidates (a FixedTree or a DynamicTree shape).

    The head drafts the tree level by level. Its pairs for tree nodes go to scratch slots
    (S per row, past the engine's pages), not to the sequence's pages: a node sees the
    committed pairs (keys < base) and its own path through a mask, and the scratch is simply
    overwritten by the next step ("the head's tree KV is thrown away"). After the target has
    verified the tree, refill moves the accepted path's target KV from slots base + 1 + node
    to base + 1 + j, where its positions belong, and reruns the head over the accepted
    tokens with the target's features, as the chain does.
    """

    def __init__(
        self,
        head: Head,
        cache: KVCache,
        attention: AttentionBackend,
        max_rows: int,
        shape: FixedTree | DynamicTree,
        target_cache: KVCache,
        scratch_start: int,
        sampled: bool = False,
        grammar_aware: bool = True,
        graphs: Callable[[Forward], Forward] | None = None,  # models/graphs.py
    ):
        super().__init__(head, cache, attention, max_rows, sampled, grammar_aware, graphs)
        self.shape = shape
        self.target_cache = target_cache
        self.scratch_start = scratch_start  # the first scratch slot (scratch_slots)

    def propose(self, plan: Plan, dev: DevicePlan) -> Drafts:
        st, shape = dev.sampling, self.shape
        sampled = self.sampled and not st.all_greedy
        walk = GrammarWalk.of(plan.seqs) if self.grammar_aware else None
        # the root's children come from the deferred outputs: the first level costs no forward
        roots = self.deferred_logits[dev.rows], self.deferred_hidden[dev.rows]
        tree = self._grow(dev, shape.grow(roots, dev.base, plan.k, st if sampled else None, walk))
        # never accept past num_drafts: deeper nodes become padding (their subtrees too)
        tokens = torch.where(tree.depths <= dev.num_drafts[:, None], tree.tokens, -1)
        depth = min(shape.depth, plan.k)
        drafts = tree_drafts(dev, tokens, tree.parents, tree.depths, depth, tree.ancestors)
        drafts.probs, drafts.noise = tree.probs, tree.noise
        if tree.probs is not None and isinstance(shape, FixedTree):  # children drawn from q
            drafts.siblings = shape.siblings
        return drafts

    def refill(self, plan: Plan, dev: DevicePlan, out: TargetOutput, verdict: Verdict) -> int:
        if verdict.path is None:  # a step that drafted nothing: a chain of width 1
            return super().refill(plan, dev, out, verdict)
        path, accepted = verdict.path, verdict.num_accepted  # [B, D], [B]
        b, d = path.shape
        move_tree_path(self.target_cache, dev.tail_slots, path, accepted)
        # pairs (emitted token j, target feature at base + j): the root's row, then the path's
        o, m = self.offset, refill_columns(accepted, d + 1)
        rows = torch.cat([torch.zeros_like(path[:, :1]), 1 + path[:, : m - 1].clamp(min=0)], 1)
        hidden = self.head.target_features(out).view(b, plan.width, -1)
        features = hidden.gather(1, rows[..., None].expand(-1, -1, hidden.shape[2]))  # [B, m, H]
        positions = dev.base[:, None] + o + torch.arange(m, device=path.device)  # [B, m]
        tokens = verdict.tokens[:, :m].clamp(min=0)
        self._defer(dev, None, tokens, features, positions, dev.tail_slots[:, o : o + m], accepted)
        self.keep_page_ends(dev, features, accepted)
        return m

    def _grow(self, dev: DevicePlan, growth: Growth) -> DraftedTree:
        """Run the head over each expansion the shape asks for, until it returns its tree."""
        try:
            expansion = next(growth)
            while True:
                expansion = growth.send(self.expand(dev, expansion))
        except StopIteration as done:
            return done.value

    def expand(self, dev: DevicePlan, x: Expansion) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the head over an expansion's m nodes per sequence; returns (logits [B, m, V]
        of their children, their head features [B, m, H])."""
        b, m = x.ids.shape
        keys = self._tree_keys(dev)
        mask = torch.cat([keys.committed.expand(b, m, -1), x.visible.expand(b, m, -1)], 2)
        # the pair (node, its parent's feature), at base + level - 1 + pair_offset
        positions = (dev.base + x.level - 1 + self.offset)[:, None].expand(b, m)
        small = AttentionMetadata(
            slot_mapping=keys.scratch[:, x.first : x.first + m].flatten(),
            kv_slots=keys.kv_slots,
            kv_lens=torch.full_like(dev.base, keys.kv_slots.shape[1]),
            q_index=torch.arange(b * m, device=x.ids.device),
            q_positions=positions,
            mask=mask,
            shared=keys.shared,
        )
        flat = x.features.reshape(b * m, -1)
        (hidden,) = self.run(x.ids.flatten(), positions.flatten(), small, flat)
        logits = self.head.logits(hidden)  # [B * m, V]
        return logits.float().view(b, m, -1), hidden.view(b, m, -1)

    def _tree_keys(self, dev: DevicePlan) -> TreeKeys:
        """The keys the step's tree levels see (built once a step)."""
        shared = dev.target_meta.shared
        if shared.tree is None:
            meta, s = dev.target_meta, self.shape.scratch_size
            device = meta.kv_slots.device
            scratch = scratch_slots(self.scratch_start, dev.rows, s, self.cache.page_size)
            keys = torch.arange(meta.kv_slots.shape[1], device=device)
            committed = (keys[None, :] < dev.base[:, None] + self.offset)[:, None]
            kv_slots = torch.cat([meta.kv_slots, scratch], 1)
            shared.tree = TreeKeys(scratch, kv_slots, committed, SharedKeys())
        return shared.tree


def scratch_slots(start: int, rows: torch.Tensor, size: int, page_size: int) -> torch.Tensor:
    """[B, size] the scratch slots of each of `rows` [B]: row r's on pages of their own from
    start + r * `size` rounded up to whole pages, so that a kernel that reads keys page by page
    (FlashInfer) finds a row's scratch keys on its pages."""
    stride = -(-size // page_size) * page_size
    return start + rows[:, None] * stride + torch.arange(size, device=rows.device)


@dataclass(frozen=True)
class Expansion:
    """Tree nodes the head runs over, m a sequence: a shape's request."""

    level: int  # the nodes' depth (their tokens sit at positions base + level)
    first: int  # the scratch index of the first; the m nodes take first .. first + m - 1
    ids: torch.Tensor  # [B, m] the nodes' tokens
    features: torch.Tensor  # [B, m, H] their parents' head features
    visible: torch.Tensor  # [B or 1, m, S] bool: the scratch nodes on each one's path


@dataclass
class DraftedTree:
    """What a tree shape drafts for a step, before num_drafts trims it."""

    tokens: torch.Tensor  # [B, n]
    parents: torch.Tensor  # [B, n] -1: a child of the root
    depths: torch.Tensor  # [B, n] from 1
    ancestors: torch.Tensor | None  # [B, n, n]; None: tree_drafts finds them
    probs: torch.Tensor | None  # [B, n, V] the q each node was drawn from; None: ranked
    noise: torch.Tensor | None  # [B, depth + 1, V] the coupling's (Drafts.noise)


# a shape's growth: yields Expansions, is sent (children's logits [B, m, V], head features
# [B, m, H]) for each, returns the tree
Growth = Generator[Expansion, tuple[torch.Tensor, torch.Tensor], DraftedTree]
Roots = tuple[torch.Tensor, torch.Tensor]  # logits [B, V] of the root's children, feature [B, H]


def _tree_noise(
    base: torch.Tensor, st: SamplingTensors | None, depth: int, vocab: int
) -> torch.Tensor | None:
    """The coupling's noise at a tree's positions base + 1 .. base + 1 + depth, for sampled
    drafting with coupled rows."""
    if st is None or st.coupled is None:
        return None
    positions = base[:, None] + 1 + torch.arange(depth + 1, device=base.device)
    return coupling_noise(st.seeds, positions, vocab, st.coupled)


@dataclass(frozen=True)
class Level:
    """A fixed tree's nodes at one depth, as picked from the children of the m nodes run at
    the depth above."""

    flat: torch.Tensor  # [n] each node's place among those nodes' top children [m * width]
    width: int  # top children taken of each node run above: the worst rank taken + 1
    fed_by: torch.Tensor  # [n] each node's parent's place among the m nodes


@dataclass(frozen=True)
class Run:
    """A fixed tree's nodes at one depth that have children: the head runs over them."""

    first: int  # the scratch index of the first; the m nodes take first .. first + m - 1
    places: torch.Tensor  # [m] their places among the depth's nodes
    feeds: torch.Tensor | None  # [m] their parents' places among the nodes run above; None: root
    visible: torch.Tensor  # [1, m, S] bool: the scratch nodes on each one's path, itself too


class FixedTree:
    """A fixed tree given as paths of child ranks (Medusa / EAGLE style): path (0, 2) is the
    third-best child of the root's best child. Nodes are ordered by depth, then path, so that
    parents come first, each depth's nodes are consecutive and any prefix of the nodes is a
    tree. For a sampled request a node's children are instead independent draws from the
    head's processed q (rank r: the draw keyed by SALT_CHILD + r), as the sampler's
    multi-draft rule needs."""

    def __init__(self, paths: tuple[tuple[int, ...], ...], device: torch.device):
        order = sorted(paths, key=lambda p: (len(p), p))
        index = {p: i for i, p in enumerate(order)}
        self.size, self.depth = len(order), max(len(p) for p in order)
        parents = [index[p[:-1]] if len(p) > 1 else -1 for p in order]
        self.siblings = max(parents.count(parent) for parent in parents)  # most children
        inner = sorted({index[p[:-1]] for p in order if len(p) > 1})  # nodes with children
        scratch = {node: e for e, node in enumerate(inner)}
        self.scratch_size = max(len(inner), 1)
        self.device = device
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)
        self.parents, self.depths = as_tensor(parents), as_tensor([len(p) for p in order])
        self.ancestors = tree_ancestors(self.parents[None], self.depth)  # [1, N, N]
        self.levels: list[Level] = []  # per depth
        self.runs: list[Run] = []  # per depth but the last
        above = [-1]  # the nodes run at the depth above (the root first)
        for level in range(1, self.depth + 1):
            nodes = [i for i, p in enumerate(order) if len(p) == level]
            width = max(order[i][-1] for i in nodes) + 1
            fed_by = [above.index(parents[i]) for i in nodes]
            flat = [place * width + order[i][-1] for place, i in zip(fed_by, nodes, strict=True)]
            self.levels.append(Level(as_tensor(flat), width, as_tensor(fed_by)))
            if level < self.depth:
                run = [e for e in inner if len(order[e]) == level]
                feeds = as_tensor([above.index(parents[e]) for e in run]) if level > 1 else None
                places = as_tensor([nodes.index(e) for e in run])
                visible = self._visible(run, parents, scratch)
                self.runs.append(Run(scratch[run[0]], places, feeds, visible))
                above = run

    def _visible(self, run: list[int], parents: list[int], scratch: dict[int, int]) -> torch.Tensor:
        """[1, m, S] bool: the scratch nodes on each run node's path, itself included."""
        visible = torch.zeros(1, len(run), self.scratch_size, dtype=torch.bool)
        for row, node in enumerate(run):
            while node >= 0:
                visible[0, row, scratch[node]] = True
                node = parents[node]
        return visible.to(self.device)

    def grow(
        self,
        roots: Roots,
        base: torch.Tensor,  # [B] the committed length's last position
        n: int,
        st: SamplingTensors | None = None,
        walk: GrammarWalk | None = None,
    ) -> Growth:
        """The first n nodes; a prefix of the nodes is a tree: its ancestors are a corner of
        the whole tree's. With `st` children are drawn from q (and kept, for the sampler);
        coupled rows take q's top Gumbel-perturbed tokens. Without, children are ranked by
        the head's logits (the order of its probabilities). With `walk` the head's logits
        are masked by each request's grammar after each node's path (grammar_masked)."""
        logits, hidden = roots  # [B, V], [B, H]
        b = logits.shape[0]
        noise = _tree_noise(base, st, self.depth, logits.shape[-1])
        children, hidden = _masked(walk, logits, None)[:, None], hidden[:, None]  # the root
        paths = above = None  # [B, m, level] the token paths of the nodes run (a grammar's)
        tokens, drawn_from = [], []  # per depth [B, its nodes], [B, its nodes, V]
        for level, nodes in enumerate(self.levels, start=1):
            if st is None:
                top = children.topk(nodes.width, dim=-1).indices.flatten(1)  # [B, m * width]
            else:
                q = process_logits(children, st)  # [B, m, V]
                top = self._children(q, nodes.width, st.seeds, base + level)
                if noise is not None and st.coupled is not None:
                    perturbed = q.log() + noise[:, level - 1, None]
                    best = perturbed.topk(nodes.width, dim=-1).indices.flatten(1)
                    top = torch.where(st.coupled[:, None], best, top)
                drawn_from.append(q.index_select(1, nodes.fed_by))
            tokens.append(top.index_select(1, nodes.flat))
            if level == self.depth:
                break
            run = self.runs[level - 1]
            ids = tokens[-1].index_select(1, run.places)  # [B, m] the nodes run at this depth
            if run.feeds is None:
                fed = hidden.expand(b, len(run.places), -1)
            else:
                fed = hidden.index_select(1, run.feeds)
            if walk is not None:  # the nodes' paths: their parents' (run above), then theirs
                paths = ids[..., None]
                if run.feeds is not None and above is not None:
                    paths = torch.cat([above.index_select(1, run.feeds), paths], 2)
                above = paths
            children, hidden = yield Expansion(level, run.first, ids, fed, run.visible)
            children = _masked(walk, children, paths)
        expand = lambda t: t[None, :n].expand(b, -1)
        ancestors = self.ancestors[:, :n, :n].expand(b, -1, -1)
        q_nodes = torch.cat(drawn_from, 1)[:, :n] if drawn_from else None
        return DraftedTree(
            torch.cat(tokens, 1)[:, :n],
            expand(self.parents),
            expand(self.depths),
            ancestors,
            q_nodes,
            noise,
        )

    @staticmethod
    def _children(q: torch.Tensor, width: int, seeds: torch.Tensor, positions: torch.Tensor):
        """[B, m * width]: `width` independent draws from each of the m rows of q [B, m, V],
        the rank-r draws keyed by (seed, the children's position, SALT_CHILD + r)."""
        b, m, vocab = q.shape
        salts = tuple(SALT_CHILD + r for r in range(width))
        u = uniforms(seeds, positions, salts).T[:, None].expand(b, m, width)  # [B, m, width]
        rows = q[:, :, None].expand(b, m, width, vocab).reshape(-1, vocab)
        return draw(rows, u.flatten()).view(b, m * width)


class DynamicTree:
    """The EAGLE-2 tree: the root's top-k children, then `depth - 1` times the k best nodes of
    the newest level (by cumulative log-probability under the head) each give their top-k
    children; the best n nodes of all these candidates form the tree. A child's score never
    exceeds its parent's, so the best n are a tree when ties keep the parent first."""

    def __init__(self, depth: int, topk: int, device: torch.device):
        self.depth, self.topk = depth, topk
        self.scratch_size = max((depth - 1) * topk, 1)  # k nodes run per deeper level
        depths = [1] * topk + [d for d in range(2, depth + 1) for _ in range(topk**2)]
        self.depths = torch.tensor(depths, dtype=torch.long, device=device)  # [C] candidates

    def grow(
        self,
        roots: Roots,
        base: torch.Tensor,  # [B] the committed length's last position
        n: int,
        st: SamplingTensors | None = None,
        walk: GrammarWalk | None = None,
    ) -> Growth:
        """n nodes, without ancestors (tree_drafts finds them) or q (children ranked by score
        are point masses). With `st`, a coupled row ranks children by their Gumbel-perturbed
        log-probability (the coupling's guess at the target's token there). With `walk` the
        head's logits are masked by each request's grammar after each candidate's path."""
        k, s = self.topk, self.scratch_size
        logits, feature = roots  # [B, V], [B, H]
        logits = _masked(walk, logits, None)
        noise = _tree_noise(base, st, self.depth, logits.shape[-1])

        def log_probs(logits: torch.Tensor, level: int) -> torch.Tensor:  # [B, ..., V]
            """The head's log-probabilities; a coupled row's perturbed by the noise at the
            level's position and renormalised (so that a child never outscores its parent).
            The other rows' noise is 0: renormalising changes them only by rounding (any
            ranking of point-mass children is lossless)."""
            logp = logits.log_softmax(-1)
            if noise is None:
                return logp
            shape = (-1,) + (1,) * (logp.dim() - 2) + (logp.shape[-1],)
            return (logp + noise[:, level].view(shape)).log_softmax(-1)

        logp = log_probs(logits, 0)
        b, device = logp.shape[0], logp.device
        score, token = logp.topk(k)  # [B, k] the newest level's candidates
        spelled = token[..., None]  # [B, c, level] their token paths (used with a grammar)
        scores, tokens, parents = [score], [token], [torch.full_like(token, -1)]
        fed = feature[:, None].expand(b, k, -1)  # [B, c, H] each candidate's parent feature
        owner = torch.full_like(token, -1)  # [B, c] scratch index of its parent (-1: root)
        paths = torch.zeros(b, s, s, dtype=torch.bool, device=device)  # scratch nodes' paths
        start = 0  # candidate index of the newest level's first candidate
        for level in range(1, self.depth):
            pick = score.topk(k).indices  # [B, k] (all of level 1)
            first = (level - 1) * k
            run = torch.arange(first, first + k, device=device)  # their scratch indices
            above = owner.gather(1, pick)  # [B, k]
            row = paths.gather(1, above.clamp(min=0)[..., None].expand(-1, -1, s))
            row = (row & (above >= 0)[..., None]) | (torch.arange(s, device=device) == run[:, None])
            paths[:, first : first + k] = row
            ids = token.gather(1, pick)
            inputs = fed.gather(1, pick[..., None].expand(-1, -1, fed.shape[2]))
            children, hidden = yield Expansion(level, first, ids, inputs, row)
            if walk is not None:
                spelled = spelled.gather(1, pick[..., None].expand(-1, -1, spelled.shape[2]))
                children = _masked(walk, children, spelled)
            child_score, child = log_probs(children, level).topk(k)  # [B, k, k]
            score = (score.gather(1, pick)[..., None] + child_score).flatten(1)  # [B, k * k]
            token = child.flatten(1)
            if walk is not None:
                spelled = torch.cat([spelled.repeat_interleave(k, 1), token[..., None]], 2)
            parents.append((start + pick).repeat_interleave(k, 1))
            start += scores[-1].shape[1]
            fed = hidden.repeat_interleave(k, 1)
            owner = run[None].expand(b, k).repeat_interleave(k, 1)
            scores.append(score)
            tokens.append(token)
        chosen, node_parents, depths = _best(
            torch.cat(scores, 1), torch.cat(tokens, 1), torch.cat(parents, 1), self.depths, n
        )
        return DraftedTree(chosen, node_parents, depths, None, None, noise)


def _masked(walk: GrammarWalk | None, logits: torch.Tensor, paths: torch.Tensor | None):
    """Head logits [B, m, V] (the root's [B, V]) masked by each row's grammar after each
    node's token path [B, m, L] (None: the root, after the committed tokens); unchanged
    without a grammar."""
    if walk is None:
        return logits
    listed = [[[]] for _ in walk.matchers] if paths is None else paths.tolist()
    allowed = walk.after(listed).to(logits.device)
    return grammar_masked(logits, allowed.view(logits.shape))


def _best(scores, tokens, parents, depths, n: int):
    """The n best candidates (scores, tokens, parents [B, C], parents as candidate indices,
    depths [C]) in candidate order, with parents as indices among the chosen."""
    b = scores.shape[0]
    # stable: a parent (an earlier candidate, never scored lower) precedes a tied child
    best = scores.sort(dim=1, descending=True, stable=True).indices[:, :n]
    chosen = best.sort(dim=1).values  # [B, n] candidate order: parents first
    inverse = torch.full_like(scores, -1, dtype=torch.long)
    inverse.scatter_(1, chosen, torch.arange(n, device=scores.device).expand(b, n))
    above = parents.gather(1, chosen)
    node_parents = torch.where(above >= 0, inverse.gather(1, above.clamp(min=0)), -1)
    return tokens.gather(1, chosen), node_parents, depths[chosen]
