"""A depth-bounded suffix tree with counts, built token by token: the structure behind suffix decoding.

For every sequence s in the tree and every start i, the tree holds the path ``s[i : i + D]``
(D = ``max_depth``; shorter at the end of s). A vertex is a token string w; its count is the
number of paths that pass through or end at it, i.e. the number of occurrences of w (those that
fit in D tokens). ``count(w + [t]) / count(w)`` estimates P(next = t | w): an occurrence of w at
the very end of a sequence has no continuation yet and counts in the denominator only.

Example (D = 3, one sequence ``a b a b c``; paths ``aba``, ``bab``, ``abc``, ``bc``, ``c``)::

    count(a) = 2, count(ab) = 2, count(aba) = 1, count(abc) = 1, count(b) = 2, count(c) = 1

After ``ab`` the continuations ``a`` and ``c`` have count 1 each, probability 1/2 each; ties go
to the continuation seen most recently (``abc`` starts at 2, ``aba`` at 0), as prompt lookup
prefers the latest copy.

Stored compressed: a node is a run of vertices that no path ends inside and that has no branch
inside, labelled by its tokens (``Node.tokens``; every vertex of a run has the same count), and a
node with one child of the same count is merged into it. Every path ends at the end of a node.
A ``SequenceWriter`` keeps, for each of a sequence's last D starts, the node where that path
ends; appending a token extends each of those paths by one vertex (one of five local edits in
``_extend``), so a sequence is added in O(D) per token and never rebuilt. ``remove`` takes a
whole sequence out again (walk each of its paths, decrement, drop empty nodes, re-merge).
Node labels are copies, so removing a sequence leaves nothing pointing into it.

``best_draft`` is the speculation of ArcticInference's suffix tree (vLLM's ``method: "suffix"``)
on a chain: for each match length m (the context's last m tokens, m < min(len(context), D)) it
follows the most frequent child from the matched vertex while the path probability (product of
the ratios above) stays >= ``min_prob``, for at most ``min(max_tokens, floor(m * factor))``
tokens; the draft's score is the sum of its tokens' probabilities (its expected accepted length
if the estimates were right), and the best score wins, the longer match on a tie.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class Node:
    __slots__ = ("tokens", "count", "children", "parent", "last")

    def __init__(self, tokens: list[int], count: int, parent: "Node | None", last: int):
        self.tokens = tokens  # the edge label: tokens from the parent's end to this node's end
        self.count = count  # paths passing through or ending at this node (the same on every vertex of the run)
        self.children: dict[int, Node] = {}  # first token of the child's label -> child
        self.parent = parent
        self.last = last  # start stamp of the newest path through this node (breaks ties between children)


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)  # estimated path probability of each token
    score: float = 0.0  # sum of probs
    match_len: int = 0  # length of the context suffix the draft continues


Match = tuple[Node, int]  # (node, tokens of its label matched): the vertex a context suffix leads to


class SuffixTree:
    def __init__(self, max_depth: int):
        assert max_depth >= 1
        self.max_depth = max_depth
        self.root = Node([], 0, None, -1)  # count = number of paths = number of tokens in the tree
        self.num_nodes = 1
        self.clock = 0  # start stamps: one per appended token, increasing

    def writer(self) -> "SequenceWriter":
        """Append a new sequence, token by token."""
        return SequenceWriter(self)

    def remove(self, tokens: list[int]) -> None:
        """Take out a sequence that a writer appended in full earlier (its paths, counts and stamps)."""
        n = len(tokens)
        for i in range(n):
            node = self.root
            node.count -= 1
            pos, end = i, min(i + self.max_depth, n)
            while pos < end:
                child = node.children[tokens[pos]]
                child.count -= 1
                if child.count == 0:  # only this path used it; a count-1 node has no children (else merged)
                    assert not child.children
                    del node.children[tokens[pos]]
                    self.num_nodes -= 1
                    break
                pos += len(child.tokens)
                node = child
            # the path ended at ``node``, or ``node`` lost a child: it may now equal its only child
            if node is not self.root and len(node.children) == 1:
                (child,) = node.children.values()
                if child.count == node.count:
                    self._merge(node, child)

    def _merge(self, node: Node, child: Node) -> None:
        """Fold ``node`` into its only child, which has the same count (no path ends at ``node``)."""
        child.tokens = node.tokens + child.tokens
        child.parent = node.parent
        node.parent.children[node.tokens[0]] = child
        self.num_nodes -= 1

    def _extend(self, node: Node, token: int, stamp: int) -> Node:
        """Extend the path ending at ``node`` (started at ``stamp``) by ``token``; return where it ends now."""
        child = node.children.get(token)
        if child is None:
            if node.count == 1 and node is not self.root:  # a leaf of this path alone: grow its label
                node.tokens.append(token)
                node.last = stamp
                return node
            leaf = Node([token], 1, node, stamp)
            node.children[token] = leaf
            self.num_nodes += 1
            return leaf
        # this path is the only one ending at ``node`` and ``child`` its only child: after the move
        # ``node`` and the child's first vertex would have equal counts, so they must not stay apart
        alone = node is not self.root and node.count == child.count + 1
        if len(child.tokens) == 1:
            child.count += 1
            child.last = stamp
            if alone:
                self._merge(node, child)
            return child
        if alone:  # move the boundary one token down: ``node`` takes the child's first vertex
            node.tokens.append(token)
            node.last = stamp
            del child.tokens[0]
            del node.children[token]
            node.children[child.tokens[0]] = child
            return node
        head = Node([token], child.count + 1, node, stamp)  # split the child after its first vertex
        del child.tokens[0]
        child.parent = head
        head.children[child.tokens[0]] = child
        node.children[token] = head
        self.num_nodes += 1
        return head

    def matches(self, context: list[int]) -> list[Match]:
        """The vertices of the context's suffixes of length m = 1, 2, ... < len(context), up to the first
        one not in the tree (a longer suffix is then absent too)."""
        out = []
        for m in range(1, min(len(context), self.max_depth)):
            node, off = self.root, 0
            for token in context[len(context) - m:]:
                if off == len(node.tokens):
                    node = node.children.get(token)
                    if node is None:
                        return out
                    off = 1
                elif node.tokens[off] == token:
                    off += 1
                else:
                    return out
            out.append((node, off))
        return out


class SequenceWriter:
    """One sequence being appended to a tree; ``ends[-m]`` is the node where its newest path of length m ends."""

    def __init__(self, tree: SuffixTree):
        self.tree = tree
        self.tokens: list[int] = []
        self.ends: list[Node] = []  # [min(len(tokens), D)] oldest (longest) path first
        self.stamps: list[int] = []  # [same] start stamp of each of those paths

    def extend(self, tokens: list[int]) -> None:
        tree = self.tree
        ends, stamps = self.ends, self.stamps
        for token in tokens:
            tree.clock += 1
            self.tokens.append(token)
            ends.append(tree.root)
            stamps.append(tree.clock)
            tree.root.count += 1
            if len(ends) > tree.max_depth:  # that path has D tokens: complete
                del ends[0], stamps[0]
            for j in range(len(ends)):
                ends[j] = tree._extend(ends[j], token, stamps[j])

    def matches(self) -> list[Match]:
        """``SuffixTree.matches`` of this sequence's own last tokens (its last min(len, D) tokens as the
        context): the path of length m = 1 .. len(ends) - 1 ends at ``ends[-m]``, at the end of that node."""
        return [(node, len(node.tokens)) for node in reversed(self.ends[1:])]


def follow(node: Node, off: int, max_tokens: int, min_prob: float) -> Draft:
    """The most frequent continuation after vertex (node, off): the child with the highest count, the most
    recent on a tie, while the path probability stays >= ``min_prob``."""
    draft = Draft()
    prob = 1.0
    while len(draft.tokens) < max_tokens and prob >= min_prob:
        if off < len(node.tokens):
            draft.tokens.append(node.tokens[off])
            draft.probs.append(prob)
            draft.score += prob
            off += 1
            continue
        best = None
        for child in node.children.values():
            if best is None or child.count > best.count or (child.count == best.count and child.last > best.last):
                best = child
        if best is None:
            break
        prob *= best.count / node.count
        node, off = best, 0
    return draft


def best_draft(matches: list[Match], max_depth: int, max_tokens: int, factor: float, min_prob: float,
               beat: float = 0.0) -> Draft | None:
    """The highest-scoring draft over the match lengths (``matches[m-1]`` = vertex of the length-m suffix),
    the longest match on a tie; None unless its score is above ``beat``.

    Match length m allows ``min(max_tokens, floor(m * factor))`` tokens, and the tree holds at most
    ``max_depth - m`` below the match; lengths whose allowance cannot beat the best so far are skipped.
    """
    best = None
    for m in range(len(matches), 0, -1):
        limit = min(max_tokens, int(m * factor + 1e-6))
        if min(limit, max_depth - m) <= beat:
            continue
        draft = follow(*matches[m - 1], limit, min_prob)
        if draft.score > beat:
            draft.match_len = m
            best, beat = draft, draft.score
    return best
