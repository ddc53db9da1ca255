"""Trees that are a prefix of the differentiated arguments' structure.

A value given per group of parameter leaves, such as one clip bound per layer, is a
pytree whose structure is a *prefix* of the parameters' (as with ``jax.tree.map``'s
extra trees and ``optax.masked``): each of its leaves applies to the whole subtree of
parameters under it, and a single value (a tree that is one leaf) applies to all.
`leaf_groups` says which entry every parameter leaf falls under, and where the tree
does not fit, raises a ``ValueError`` naming the path.
"""

from __future__ import annotations

import jax

__all__ = ["leaf_groups"]


def _keystr(path) -> str:
    return jax.tree_util.keystr(tuple(path)) or "<root>"


def _mismatch(what, entry, entries, treedef, error) -> str:
    """Why the tree with ``entries`` (``(path, value)``) is not a prefix of ``treedef``:
    the first entry with no parameters under it, or the first parameter leaf with no
    entry above it; else the node types differ (JAX's message)."""
    index_tree = jax.tree.unflatten(treedef, list(range(treedef.num_leaves)))
    leaf_paths = [tuple(p) for p, _ in jax.tree_util.tree_flatten_with_path(index_tree)[0]]
    entry_paths = [tuple(p) for p, _ in entries]
    for ep in entry_paths:
        if any(lp[: len(ep)] == ep for lp in leaf_paths):
            continue
        above = [lp for lp in leaf_paths if ep[: len(lp)] == lp]
        if above:
            return (
                f"{what}: the {entry} at {_keystr(ep)} lies below the parameter leaf "
                f"{_keystr(above[0])}; a {entry} applies to a whole leaf or subtree of the "
                "parameters, so give one for that leaf."
            )
        return (
            f"{what}: the {entry} at {_keystr(ep)} matches no parameters: the parameters have "
            f"no subtree at {_keystr(ep)}. The tree must be a prefix of the parameters' "
            f"structure (the same keys, each {entry} standing for the subtree under it)."
        )
    for lp in leaf_paths:
        if not any(lp[: len(ep)] == ep for ep in entry_paths):
            return (
                f"{what}: the parameter leaf {_keystr(lp)} has no {entry} above it. The "
                "tree must be a prefix of the parameters' structure: give one for the leaf "
                "or for a subtree holding it."
            )
    return (
        f"{what}: the tree is not a prefix of the parameters' structure (the paths agree, "
        f"but a node's type differs, e.g. a list for a tuple or a dict for a dataclass): "
        f"{error}"
    )


def leaf_groups(tree, treedef, what, entry="entry"):
    """``(entries, groups)``: ``entries`` the ``(path, value)`` of every leaf of ``tree``
    (the path as ``jax.tree_util.keystr`` writes it, empty for a single value), and
    ``groups[i]`` the index in ``entries`` of the one above leaf ``i`` of ``treedef``.

    ``tree`` is a prefix of the structure ``treedef`` (None in it is a leaf, refused
    earlier by whoever validates the values). ``what`` names the argument in errors and
    ``entry`` its values ("bound").
    """
    flat, prefix_def = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)
    entries = [(jax.tree_util.keystr(p), x) for p, x in flat]
    index_tree = jax.tree.unflatten(treedef, list(range(treedef.num_leaves)))
    try:
        subtrees = prefix_def.flatten_up_to(index_tree)
    except (ValueError, TypeError) as e:
        raise ValueError(_mismatch(what, entry, flat, treedef, e)) from None
    groups = [None] * treedef.num_leaves
    for k, sub in enumerate(subtrees):
        for i in jax.tree.leaves(sub):
            groups[i] = k
    return entries, groups
