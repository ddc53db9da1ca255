"""The package's shape, checked on its source: JAX internals only through compat, no
import circle among the private modules and no import from a lower layer to a higher
one, layer kinds chosen by a registry keyed by primitive objects (and never compared by
name outside the kernel modules)."""

from __future__ import annotations

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo

import jaxpr_surgery as js
from jaxpr_surgery._src import compat
from jaxpr_surgery._src.sites import base
from jaxpr_surgery._src.sites.generic import GenericKernel

PKG = pathlib.Path(js.__file__).parent
SRC = PKG / "_src"

# --------------------------------------------------------------------------- #
# Reading imports from the source
# --------------------------------------------------------------------------- #
# What only compat.py may import. ``jax.extend`` is public, but without the
# compatibility promise of ``jax``/``jax.numpy``/``jax.lax``: it churns, so it goes
# through compat like the internals do. Attribute reads of the public ``jax.core``
# (``jax.core.Tracer``) are allowed.
INTERNAL = ("jax._src", "jax.interpreters", "jax.extend", "jax.lib", "jaxlib")


def _module_name(path: pathlib.Path) -> str:
    """``jaxpr_surgery._src.sites.base`` for ``.../_src/sites/base.py``."""
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _dotted(node) -> str | None:
    """``a.b.c`` of an attribute chain on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def imports_of(source: str, module: str, is_package: bool = False):
    """``[(lineno, imported module)]`` of every import in ``source`` (module level or
    inside functions), with ``from a import b`` giving both ``a`` and ``a.b`` (``b`` may
    be a submodule), relative imports resolved against ``module``, and the module
    names passed to ``__import__`` / ``importlib.import_module`` as strings."""
    pkg = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = pkg.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base_name = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base_name = node.module
            out.append((node.lineno, base_name))
            out += [(node.lineno, f"{base_name}.{a.name}") for a in node.names if a.name != "*"]
        elif isinstance(node, ast.Call):
            fn = _dotted(node.func)
            if fn in ("__import__", "importlib.import_module", "import_module") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    out.append((node.lineno, arg.value))
    return out


def internal_uses(source: str, module: str, is_package: bool = False):
    """``[(lineno, name)]``: imports of `INTERNAL` modules, and attribute chains into
    them (``jax._src.core.Var`` reached from ``import jax``)."""
    bad = [
        (ln, name)
        for ln, name in imports_of(source, module, is_package)
        if any(name == p or name.startswith(p + ".") for p in INTERNAL)
    ]
    tree = ast.parse(source)
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:  # whole chains
            name = _dotted(node)
            if name and any(name == p or name.startswith(p + ".") for p in INTERNAL):
                bad.append((node.lineno, name))
    return sorted(set(bad))


def _sources(root=PKG):
    for path in sorted(root.rglob("*.py")):
        yield path, _module_name(path), path.read_text(), path.name == "__init__.py"


# --------------------------------------------------------------------------- #
# 1. JAX internals only through compat
# --------------------------------------------------------------------------- #
def test_only_compat_imports_jax_internals():
    bad = []
    for path, module, src, is_pkg in _sources():
        if path == SRC / "compat.py":
            continue
        bad += [f"{path.relative_to(PKG)}:{ln}: {name}" for ln, name in internal_uses(
            src, module, is_pkg)]
    assert not bad, (
        "JAX internals (and jax.extend) are read in jaxpr_surgery/_src/compat.py only; "
        "move these into compat and import the name from there:\n" + "\n".join(bad)
    )


def test_compat_does_import_internals():
    """The scan sees compat's own imports (so the test above can fail)."""
    src = (SRC / "compat.py").read_text()
    names = {n for _, n in internal_uses(src, "jaxpr_surgery._src.compat")}
    assert "jax._src.lax.lax" in names and "jax.extend" in names


@pytest.mark.parametrize(
    "source",
    [
        "from jax._src import core",
        "import jax._src.lax.lax as l",
        "def f():\n    from jax.interpreters import ad\n",
        "from jax import extend as jex",
        "import jaxlib.xla_client",
        "x = __import__('jax._src.pjit', fromlist=['x'])",
        "import importlib\nm = importlib.import_module('jax._src.lax.parallel')",
        "import jax\nT = jax._src.core.Tracer",
        "import jax\np = jax.interpreters.batching.primitive_batchers",
    ],
)
def test_internal_import_scan_catches(source):
    assert internal_uses(source, "jaxpr_surgery._src.example")


@pytest.mark.parametrize(
    "source",
    [
        "import jax\nimport jax.numpy as jnp\nfrom jax import lax",
        "from jax.lax import GatherScatterMode",
        "import jax\nok = isinstance(1, jax.core.Tracer)",
        "from jax.experimental import pallas",
        "from jaxpr_surgery._src import compat\np = compat.dot_general_p",
    ],
)
def test_internal_import_scan_allows_public_jax(source):
    assert not internal_uses(source, "jaxpr_surgery._src.example")


# --------------------------------------------------------------------------- #
# 2. Layers of the private modules, and no import circle
# --------------------------------------------------------------------------- #
# Top to bottom. A module imports modules of its own layer or of layers below it (any
# import, at module level or inside a function), never above; a package (sites,
# optim) is placed as a whole. Modules beside the main line (api/explain -> engine ->
# interpreter -> sites -> tiling -> stats -> compat) sit where their imports put them.
LAYERS = (
    # entry points (explain, partials and privacy build on api)
    ("api", "check", "explain", "explain_table", "optim", "partials", "privacy", "laws"),
    ("arguments",),  # a call's arguments: parameters, batch, the statistics flattened
    ("chunking",),  # sizes chunks by lowering the engine
    ("gathers",),  # hand-written FSDP: leaves gathered over the examples' axis (api uses it)
    ("untyped",),  # what an untyped body (check_vma=False, pmap) cannot give (api uses it)
    ("devices",),  # a batch sharded by XLA: reduced device by device (api uses it)
    ("engine",),
    ("leaves",),  # a leaf's statistics from its sites' ingredients (single site, tying)
    ("clipping", "ghost_cross"),
    ("plans",),  # each leaf's mode, each site's kernel and requests
    ("segments",),  # a clipped sum's layers recomputed from a few kept values
    ("interpreter",),
    ("site_fns",),  # the call at each site: its forward, and a backward into its sink
    # the analysis asks the site registry (sites.base.kind_for) which kernel serves a site
    ("analysis", "analysis_types"),
    ("sites",),  # one module per layer kind, and the registry
    ("kron", "dots"),  # reductions whose fast rules the kernels call
    ("tiling",),
    ("fused",),
    ("stats", "stats_research", "independence"),
    ("statistic",),  # the Statistic protocol and the built-in statistics' classes
    # example weights and clipped sums as reductions; the Kronecker moments' reduction
    ("weighting", "clip_reductions", "kron_sum"),
    ("reductions",),  # the Reduction protocol and the built-in reductions
    ("moments", "fn_equality"),  # merges of moments; equality of a reduction's functions
    ("fingerprint",),  # structural keys: repeated layers and per-leaf functions traced once
    # a site's view of its leaf; norms past the range of their squares; example weights;
    # trees given as a prefix of the parameters'; blocks of features (cuts); the keys of
    # a site's requests and sink
    ("views", "norms", "example_weights", "prefix", "cuts", "custom_ops", "sink_keys", "flops",
     "explicit"),  # (explicit: a loss annotated for Explicit mesh axes, run in Auto mode)
    ("walker",),  # how structured primitives nest jaxprs; the one walk of a jaxpr
    ("compat", "versions", "meshes"),
)

# Edges allowed against the layers (none: the reduction protocol removed the last two,
# fused <-> tiling and tiling -> sites.base).
KNOWN_EDGES: set = set()

_PREFIX = "jaxpr_surgery._src."


def _layer_of(name: str) -> int:
    top = name.split(".")[0]
    for i, group in enumerate(LAYERS):
        if top in group:
            return i
    raise AssertionError(
        f"jaxpr_surgery/_src/{name.replace('.', '/')}: not placed in LAYERS of "
        "tests/test_architecture.py; add it to the layer its imports put it in."
    )


def src_graph(known=frozenset()):
    """``{module: {(imported module, lineno)}}`` among ``_src`` modules (names without
    the ``jaxpr_surgery._src.`` prefix), without the edges in ``known``. Importing
    ``a.b`` runs package ``a`` first: an edge to ``a`` too, unless the importer is
    inside ``a``."""
    modules = {}
    for _path, module, src, is_pkg in _sources(SRC):
        if module.startswith(_PREFIX):
            modules[module[len(_PREFIX):]] = (src, is_pkg)
    graph = {}
    for name, (src, is_pkg) in modules.items():
        edges = set()
        for ln, imp in imports_of(src, _PREFIX + name, is_pkg):
            if not imp.startswith(_PREFIX):
                continue
            target = imp[len(_PREFIX):]
            if target not in modules or (name, target) in known:
                continue
            parts = target.split(".")
            for k in range(1, len(parts) + 1):
                t = ".".join(parts[:k])
                own = name == t or name.startswith(t + ".")
                if t in modules and not own and t != name:
                    edges.add((t, ln))
        graph[name] = edges
    return graph


def _cycles(graph):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w, _ in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_among_src_modules():
    cycles = _cycles(src_graph(KNOWN_EDGES))
    assert not cycles, f"import circles among jaxpr_surgery/_src modules: {cycles}"


def test_no_import_from_a_lower_layer_to_a_higher_one():
    graph = src_graph(KNOWN_EDGES)
    bad = sorted(
        f"{a} (layer {_layer_of(a)}) imports {b} (layer {_layer_of(b)}) at line {ln}"
        for a, edges in graph.items()
        for b, ln in edges
        if _layer_of(b) < _layer_of(a)
    )
    assert not bad, "imports against the layers of tests/test_architecture.py:\n" + "\n".join(
        bad
    )


def test_layer_checks_can_fail():
    """The checks see a circle and an upward edge added to the real graph."""
    graph = {a: list(edges) for a, edges in src_graph().items()}
    graph["fused"].append(("tiling", 0))  # tiling imports fused: a circle
    assert any({"fused", "tiling"} <= set(c) for c in _cycles(graph))
    assert _layer_of("sites.base") < _layer_of("tiling")  # tiling -> sites.base: upward


# --------------------------------------------------------------------------- #
# Module sizes: one concept a module (issue 60: the engine at most 500 lines, no
# module over 800). Split a module that grows past its limit by concept.
# --------------------------------------------------------------------------- #
MAX_LINES = 800
MAX_LINES_OF = {"engine": 500}


def _sizes():
    return {
        _module_name(path)[len(_PREFIX):]: len(src.splitlines())
        for path, _, src, _ in _sources(SRC)
    }


def _too_long(sizes):
    return [
        f"jaxpr_surgery/_src/{name}: {n} lines (at most {MAX_LINES_OF.get(name, MAX_LINES)})"
        for name, n in sorted(sizes.items()) if n > MAX_LINES_OF.get(name, MAX_LINES)
    ]


def test_no_module_grows_past_its_limit():
    bad = _too_long(_sizes())
    assert not bad, "modules over their size (split by concept):\n" + "\n".join(bad)


def test_size_check_can_fail():
    sizes = _sizes()
    assert not _too_long(sizes)
    assert _too_long({**sizes, "engine": 501})
    assert _too_long({**sizes, "views": MAX_LINES + 1})


# --------------------------------------------------------------------------- #
# One walker (issue 60): how a structured primitive nests a jaxpr is read in walker.py
# alone; the passes reach nested jaxprs through its views (walker.nested, bodies)
# --------------------------------------------------------------------------- #
# the params holding a structured primitive's jaxpr (and scan's operand split)
NESTED_PARAMS = {"jaxpr", "call_jaxpr", "fun_jaxpr", "cond_jaxpr", "body_jaxpr", "branches",
                 "num_consts", "num_carry", "ft_in"}


def nested_reads(source: str):
    """``[(lineno, what)]`` of the reads of `NESTED_PARAMS` (``params["jaxpr"]``,
    ``params.get("branches")``) and of ``compat.subjaxprs``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Attribute) and node.attr == "subjaxprs"
                and _dotted(node.value) == "compat"):
            out.append((node.lineno, "compat.subjaxprs"))
        elif (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
                and node.slice.value in NESTED_PARAMS):
            out.append((node.lineno, f"[{node.slice.value!r}]"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get" and node.args
                and isinstance(node.args[0], ast.Constant)
                and node.args[0].value in NESTED_PARAMS):
            out.append((node.lineno, f".get({node.args[0].value!r})"))
    return sorted(out)


def test_nested_jaxprs_are_read_by_the_walker_alone():
    bad = []
    for path, _, src, _ in _sources(SRC):
        if path.name in ("compat.py", "walker.py"):
            continue
        bad += [f"{path.relative_to(PKG)}:{ln}: {n}" for ln, n in nested_reads(src)]
    assert not bad, "read nested jaxprs through walker.nested / walker.bodies:\n" + "\n".join(bad)


def test_nested_read_check_can_fail():
    assert nested_reads("x = compat.subjaxprs(eqn)\n") == [(1, "compat.subjaxprs")]
    assert nested_reads("j = eqn.params['jaxpr']\n") == [(1, "['jaxpr']")]
    assert nested_reads("j = eqn.params.get('branches')\n") == [(1, ".get('branches')")]
    assert not nested_reads("x = walker.nested(eqn).length\n")


# --------------------------------------------------------------------------- #
# 3. Layer kinds: a registry keyed by primitive objects
# --------------------------------------------------------------------------- #
def test_registry_is_keyed_by_primitive_objects():
    assert base.SITE_RULES, "no kernel registered"
    for prim, kernels in base.SITE_RULES.items():
        assert isinstance(prim, compat.Primitive), prim
        for k in kernels:
            assert prim in k.anchors and base.KERNELS[k.kind] is k
        prios = [k.priority for k in kernels]
        assert prios == sorted(prios, reverse=True)
    assert base._DEFAULT == [GenericKernel]
    assert sorted(base.KERNELS) == [
        "conv", "custom-op", "dense", "embedding", "generic", "merged-lora",
        "onehot-embedding", "ragged-dense", "scale-shift",
    ]


def _kind_strings():
    return set(base.KERNELS)


def test_kind_names_are_not_compared_outside_the_kernel_modules():
    """Other modules ask kernels for capabilities; a kind's name is for display."""
    kinds = _kind_strings()
    bad = []
    for path, _, src, _ in _sources(SRC):
        if path.parent == SRC / "sites":
            continue
        for node in ast.walk(ast.parse(src)):
            if not isinstance(node, ast.Compare):
                continue
            consts = []
            for c in [node.left, *node.comparators]:
                elts = c.elts if isinstance(c, (ast.Tuple, ast.List, ast.Set)) else [c]
                consts += [e.value for e in elts if isinstance(e, ast.Constant)]
            hit = sorted({c for c in consts if c in kinds})
            if hit:
                bad.append(f"{path.relative_to(PKG)}:{node.lineno}: compares with {hit}")
    assert not bad, "\n".join(bad)


@pytest.fixture
def registry(monkeypatch):
    """A private copy of the registry for registering test kernels."""
    monkeypatch.setattr(base, "KERNELS", dict(base.KERNELS))
    monkeypatch.setattr(base, "SITE_RULES", {p: list(v) for p, v in base.SITE_RULES.items()})
    monkeypatch.setattr(base, "_DEFAULT", list(base._DEFAULT))
    return base


def test_duplicate_registration_raises(registry):
    class Again(GenericKernel):
        kind = "dense"
        anchors = (compat.dot_general_p,)

        @classmethod
        def matches(cls, eqn, tag, pos, patterns):
            return True

    with pytest.raises(ValueError, match="'dense' is already registered"):
        registry.register(Again)
    with pytest.raises(ValueError, match="already the default"):
        registry.register_default(type("Other", (GenericKernel,), {"kind": "other"}))


@pytest.mark.parametrize(
    "attrs, match",
    [
        ({"kind": "x"}, "must set its own 'anchors'"),  # inherited (empty) anchors
        ({"kind": "x", "anchors": ()}, "non-empty tuple of primitive"),
        ({"kind": "x", "anchors": ("dot_general",)}, "non-empty tuple of primitive"),
        ({"kind": "x", "anchors": [compat.mul_p]}, "non-empty tuple of primitive"),
        ({"anchors": (compat.mul_p,)}, "must set its own 'kind'"),
        ({"kind": "", "anchors": (compat.mul_p,)}, "non-empty str"),
    ],
)
def test_bad_registration_raises(registry, attrs, match):
    attrs = dict(attrs, matches=classmethod(lambda cls, *a: True))
    with pytest.raises(TypeError, match=match):
        registry.register(type("Bad", (GenericKernel,), attrs))
    assert "x" not in registry.KERNELS and "" not in registry.KERNELS


def test_registering_without_matches_raises(registry):
    with pytest.raises(TypeError, match="must define matches"):
        registry.register(type("NoMatch", (GenericKernel,), {"kind": "y", "anchors": (
            compat.mul_p,)}))


def _site_eqn(fn, *args):
    (eqn,) = jax.make_jaxpr(fn)(*args).jaxpr.eqns
    return eqn


class _Tag:
    pre = ()


def test_kind_for_default_and_priority(registry):
    w, x = jnp.ones((3, 2)), jnp.ones((4, 3))
    div = _site_eqn(lambda w, x: x / w, w[:, 0], x[:3, 0])
    assert registry.kind_for(div, _Tag(), [1], {}) is GenericKernel  # nothing anchored on div
    dot = _site_eqn(lambda w, x: x @ w, w, x)
    assert registry.kind_for(dot, _Tag(), [1], {}).kind == "dense"

    def kernel(name, prio, ok=True):
        return type(name, (GenericKernel,), {
            "kind": name, "anchors": (compat.dot_general_p,), "priority": prio,
            "matches": classmethod(lambda cls, *a: ok)})

    low, high, never = kernel("low", -1), kernel("high", 5), kernel("never", 9, ok=False)
    for k in (low, high, never):
        registry.register(k)
    assert registry.SITE_RULES[compat.dot_general_p][:2] == [never, high]
    assert registry.SITE_RULES[compat.dot_general_p][-1] is low
    assert registry.kind_for(dot, _Tag(), [1], {}) is high


def test_a_new_kind_is_one_registration(registry):
    """A kernel registered at a primitive no kind anchors on serves those sites, with
    correct statistics, without touching the analysis (here: the generic rule under
    its own name)."""

    @registry.register
    class DivKernel(GenericKernel):
        kind = "divide"
        anchors = (compat.div_p,)

        @classmethod
        def matches(cls, eqn, tag, pos, patterns):
            return pos == [1]

    def loss(p, b):
        return jnp.mean(jnp.sum(jnp.tanh(b / p["s"]) ** 2, axis=-1))

    rng = np.random.default_rng(0)
    p = {"s": jnp.asarray(rng.uniform(1.0, 2.0, size=(3,)), jnp.float32)}
    b = jnp.asarray(rng.normal(size=(5, 3)), jnp.float32)
    rep = js.explain(loss, js.stats.second_moment())(p, b)
    assert rep.leaves[0].kinds == ["divide"], str(rep)
    got = js.per_example_stat(loss, js.stats.second_moment())(p, b)["s"]
    g = jax.jit(jax.vmap(jax.grad(lambda p, x: loss(p, x[None])), in_axes=(None, 0)))(p, b)["s"]
    np.testing.assert_allclose(got, jnp.mean(g**2, axis=0), rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------- #
# 4. What other modules ask of kernels (capabilities, not kind names)
# --------------------------------------------------------------------------- #
def _tied(p, b):
    h = jnp.tanh(p["emb"][b["ids"]])  # [B, T, d]
    return jnp.mean(jnp.sum(jnp.sin(h @ p["emb"].T), axis=(1, 2)))


def _tied_onehot(p, b):
    oh = jax.nn.one_hot(b["ids"], p["emb"].shape[0])
    h = jnp.tanh(oh @ p["emb"])
    return jnp.mean(jnp.sum(jnp.sin(h @ p["emb"].T), axis=(1, 2)))


@pytest.mark.parametrize("loss, cross", [(_tied, True), (_tied_onehot, False)])
def test_tied_table_ghost_cross_term(loss, cross):
    """A gathered embedding and a dense site on one table have a ghost cross term; a
    one-hot embedding does not (its rows lie on a one-hot axis of a view)."""
    rng = np.random.default_rng(1)
    with zoo.x64():
        p = {"emb": jnp.asarray(rng.normal(size=(7, 3)) / 2)}
        b = {"ids": jnp.asarray(rng.integers(0, 7, size=(4, 5)))}
        rep = js.explain(loss, js.stats.sq_norms())(p, b)
        # the gathered table offers the cross terms (the cost model then picks a route);
        # the one-hot one takes the tiles of its summed gradient
        if cross:
            assert "ghost cross terms" in rep.leaves[0].detail, str(rep)
        else:
            assert "tiled products of the shared leaf" in rep.leaves[0].detail, str(rep)
        got = js.per_example_stat(loss, js.stats.sq_norms())(p, b)
        g = jax.vmap(
            jax.grad(lambda p, x: loss(p, jax.tree.map(lambda v: v[None], x))), in_axes=(None, 0)
        )(p, b)["emb"]
        np.testing.assert_allclose(got, jnp.sum(g**2, axis=(1, 2)), rtol=1e-10)


def _two_dense(p, b):
    return jnp.mean(jnp.sum(jnp.tanh(jnp.tanh(b @ p["w"]) @ p["w"]), axis=tuple(range(1, b.ndim))))


def _two_gathers(p, b):
    h = p["w"][b[:, :, 0]] * p["w"][b[:, :, 1]]
    return jnp.mean(jnp.sum(jnp.tanh(h), axis=(1, 2)))


@pytest.mark.parametrize(
    "loss, shape, per_example",
    [
        (_two_dense, (5, 6, 4), True),  # token axis: 2-D matmuls, one example a tile
        (_two_dense, (5, 4), False),  # no token axis: tiles by budget
        (_two_gathers, (5, 3, 2), False),  # gathers: tiles by budget
    ],
)
def test_shared_leaf_tiles_one_example_where_a_site_has_token_matmuls(
    loss, shape, per_example, monkeypatch
):
    from jaxpr_surgery._src import tiling

    monkeypatch.setattr(tiling, "prefer_per_example", lambda: True)  # as on CPU
    rng = np.random.default_rng(2)
    p = {"w": jnp.asarray(rng.normal(size=(4, 4)) / 2, jnp.float32)}
    if loss is _two_gathers:
        b = jnp.asarray(rng.integers(0, 4, size=shape))
    else:
        b = jnp.asarray(rng.normal(size=shape), jnp.float32)
    rep = js.explain(loss, js.stats.second_moment())(p, b)
    how = rep.leaves[0].detail
    assert "tiled products of the shared leaf" in how, str(rep)
    assert ("(1 example/tile" in how) is per_example, str(rep)
    got = js.per_example_stat(loss, js.stats.second_moment())(p, b)["w"]
    g = jax.jit(jax.vmap(jax.grad(lambda p, x: loss(p, x[None])), in_axes=(None, 0)))(p, b)["w"]
    np.testing.assert_allclose(got, jnp.mean(g**2, axis=0), rtol=2e-5, atol=1e-7)


def _tied_square(p, b):  # V == d: only the index maps tell rows from columns
    h = jnp.tanh(p["emb"][b["ids"]])
    return jnp.mean(jnp.sum(jnp.sin(h @ p["emb"].T), axis=(1, 2)))


def _tied_square_transposed(p, b):  # rows gathered from the transpose: no cross term
    h = jnp.tanh(p["emb"].T[b["ids"]])
    return jnp.mean(jnp.sum(jnp.sin(h @ p["emb"].T), axis=(1, 2)))


def _tied_same_side(p, b):  # the table as a dense weight of its own orientation
    h = jnp.tanh(p["emb"][b["ids"]])  # [B, T, d]
    z = jnp.einsum("btd,vd->btv", h, p["emb"])
    return jnp.mean(jnp.sum(jnp.sin(z), axis=(1, 2)))


def _tied_einsum_vd(p, b):
    h = jnp.tanh(p["emb"][b["ids"]])
    z = jnp.einsum("btv,vd->btd", jnp.sin(h @ p["emb"].T), p["emb"])
    return jnp.mean(jnp.sum(z, axis=(1, 2)))


@pytest.mark.parametrize("loss, shape", [
    (_tied, (7, 3)), (_tied_square, (4, 4)), (_tied_square_transposed, (4, 4)),
    (_tied_same_side, (7, 3)), (_tied_einsum_vd, (7, 3)), (_tied_onehot, (7, 3)),
])
def test_tied_cross_layout_by_axes_equals_index_arrays(loss, shape, monkeypatch):
    """The ghost cross term's layout, decided from the views' axis permutations (no
    index arrays of the table's size: seconds at GPT-2's vocabulary), is what the
    index arrays say, on every pair of sites of a tied table; and the statistic
    stays exact."""
    from jaxpr_surgery._src import ghost_cross

    seen = []
    inner = ghost_cross._cross_layout

    def spy(sa, ka, sb, kb, by_axes=True):
        fast, arrays = inner(sa, ka, sb, kb), inner(sa, ka, sb, kb, by_axes=False)
        seen.append((fast, arrays))
        return fast

    monkeypatch.setattr(ghost_cross, "_cross_layout", spy)
    rng = np.random.default_rng(2)
    with zoo.x64():
        p = {"emb": jnp.asarray(rng.normal(size=shape) / 2)}
        b = {"ids": jnp.asarray(rng.integers(0, shape[0], size=(4, 5)))}
        got = js.per_example_stat(loss, js.stats.sq_norms())(p, b)
        g = jax.vmap(
            jax.grad(lambda p, x: loss(p, jax.tree.map(lambda v: v[None], x))), in_axes=(None, 0)
        )(p, b)["emb"]
        np.testing.assert_allclose(got, jnp.sum(g**2, axis=(1, 2)), rtol=1e-10)
    assert seen, "no pair of sites on the tied table"
    for fast, arrays in seen:
        assert fast == arrays, seen
