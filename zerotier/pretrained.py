"""Pretrained weights streamed into the tiers: `zerotier.from_pretrained(dir, config)`.

[Note: streamed pretrained loading]
A Hugging Face model directory (`config.json` plus `model.safetensors`, or shards listed by
`model.safetensors.index.json`) becomes an Engine without the model ever being whole in RAM:
  1. the transformers model is built from config.json on the meta device (fp32; the
     engine's precision.param_dtype, not the file's dtype, decides what compute sees);
  2. every name the model has is matched to a tensor of the files before anything is
     allocated, from the safetensors headers alone: a tensor the model needs and the files
     lack, a tensor the files hold and the model lacks, or a shape that differs is a
     ConfigError naming them, as transformers' strict load would refuse them;
  3. `initialize` materializes the model unit by unit ([Note: meta-device models]) and our
     init_fn copies each module's tensors out of the memory-mapped files (`safe_open`
     reads only the tensors asked for), each converted to the parameter's dtype — so RAM
     holds two units' tensors at a time (the one being placed, and the next one, read
     meanwhile: [Note: materializing ahead] in materialize.py), on top of whatever the tiers hold.
Names. Tied weights are one Parameter under several names (GPT-2's `lm_head.weight` is
`transformer.wte.weight`); save_pretrained writes one of them, so a Parameter needs any one
of its names in the files. A file holding two tied names with different values (a config
that says tie_word_embeddings, a checkpoint trained untied) is loaded untied, with a warning,
as transformers does: the later name gets its own Parameter and leaves
`all_tied_weights_keys`. A checkpoint of the base model (`h.0...`) loads into the task
model (`transformer.h.0...`) and a task model's into its base model (its head is then not
read), by the model's `base_model_prefix`, as transformers does; the model's own
`_keys_to_ignore_on_load_unexpected` patterns and stale copies of computed buffers
(`rotary_emb.inv_freq`, `position_ids`) in old files are not errors either.
Non-persistent buffers (rotary `inv_freq`) are in no file: the model computes them, with
its `_init_weights(module)` — what transformers' own loading does for them. They are
filled with a sentinel first (NaN, or the integer minimum) and one still holding it after
is a ConfigError: never uninitialized memory.

[Note: LoRA on a streamed base]
`from_pretrained(dir, config, peft_config=LoraConfig(...))` applies
`peft.get_peft_model(model, peft_config, low_cpu_mem_usage=True)` to the meta model, so the
adapters are meta too, and `initialize` then places the whole peft model: the frozen base
streams from the files into its frozen units ([Note: frozen units] in state.py), never whole
in RAM, which loading with transformers and applying peft before initialize cannot avoid.
peft renames the base weights it wraps (`q_proj.weight` -> `q_proj.base_layer.weight`,
`lm_head.weight` -> `lm_head.original_module.weight` and its trained copy
`lm_head.modules_to_save.<adapter>.weight`): those segments are dropped to find the
checkpoint's name. The adapter tensors are in no checkpoint: the init_fn runs peft's own
`LoraLayer.reset_lora_parameters(adapter, init_lora_weights)` on the layer as each adapter
module is materialized (lora_A kaiming-uniform or gaussian, lora_B zeros; with
init_lora_weights=False nn.Linear's init, as peft leaves them). Seeded alike, the adapters
equal peft's own: peft on a model in RAM draws each layer's adapters from the global random
stream in module order (update_layer: nn.Linear's init of lora_A then lora_B, or torch.randn
for embedding adapters, then reset_lora_parameters), so from_pretrained keeps the stream's
state before each layer's draws and advances the stream past them, drawing into scratch, as
peft does; materializing an adapter module replays its layer's draws from that state. The
user's stream after from_pretrained is also where peft leaves it. The replay sets every
adapter tensor of the layer, so the layer's other adapter tensors are CPU scratch during the
call: one placed already (lora_A and lora_B in units of their own under wrap=) is a released
view that must not be written. Inits that read the base weights (PiSSA, OLoRA, LoftQ, EVA,
CorDA, DoRA's magnitude) and tuners other than LoRA are refused with the working order.
"""
from __future__ import annotations

import contextlib
import json
import re
import warnings
from pathlib import Path

import torch

from .engine.engine import Engine, initialize
from .errors import ConfigError

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
# stale copies of buffers the model computes, found in older checkpoints (transformers skips them too)
_COMPUTED_IN_OLD_FILES = (r"rotary_emb\.inv_freq", r"(^|\.)position_ids$")


def _libraries():
    try:
        import transformers
        from safetensors import SafetensorError, safe_open
    except ImportError as exc:
        raise ConfigError(f"zerotier.from_pretrained needs transformers and safetensors ({exc}): "
                          "pip install 'zerotier-offload[hf]'") from exc
    return transformers, safe_open, SafetensorError


def from_pretrained(path, config=None, *, model_cls=None, wrap=None, peft_config=None) -> Engine:
    """An Engine training the transformers model saved in the Hugging Face directory `path`,
    its weights streamed from the safetensors files unit by unit into the tiers `config`
    places them on ([Note: streamed pretrained loading]). model_cls: the class that builds the
    model from config.json (AutoModelForCausalLM by default; AutoModel, LlamaForCausalLM ...).
    wrap: as for zerotier.initialize. peft_config: a peft.LoraConfig; the model is then the
    peft model, its base frozen and streamed, its adapters initialized as peft does ([Note:
    LoRA on a streamed base]). The model is `engine.module`."""
    transformers, safe_open, safetensor_error = _libraries()
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"{path}: no config.json; a Hugging Face model directory holds config.json and "
                          f"{_SINGLE} (or {_INDEX} and its shards), as save_pretrained writes it")
    model = _build_on_meta(path, transformers, model_cls)
    adapters = _LoraAdapters(model, peft_config) if peft_config is not None else None
    with _SafetensorsFiles(path, safe_open, safetensor_error) as files:
        loader = _Loader(model, files, adapters)
        return initialize(adapters.peft_model if adapters else model, config, wrap=wrap, init_fn=loader.fill)


# config.json keys that size the model (transformers' names across architectures): each a whole
# number > 0, or null where the architecture derives it (n_inner, head_dim, num_key_value_heads).
_DIMS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
         "vocab_size", "max_position_embeddings", "head_dim", "n_embd", "n_layer", "n_head", "n_inner",
         "n_positions", "n_ctx", "d_model", "d_ff", "d_kv", "num_layers", "num_heads", "ffn_dim",
         "moe_intermediate_size", "num_local_experts", "num_experts_per_tok")
_DIMS_MAY_BE_NULL = ("n_inner", "head_dim", "num_key_value_heads")


def _check_config_json(path: Path) -> None:
    """A config.json transformers would build from, with every size a whole number > 0: a negative
    intermediate_size otherwise reaches torch as an error that names no file."""
    file = path / "config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{file}: cannot read it as JSON ({exc}); save_pretrained writes a readable one") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{file}: expected a JSON object of model settings, got {type(config).__name__}")
    for section, settings in (("", config), ("text_config.", config.get("text_config"))):
        for key in _DIMS if isinstance(settings, dict) else ():
            value = settings.get(key)
            if key not in settings or (value is None and key in _DIMS_MAY_BE_NULL):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{file}: {section}{key} = {value!r}: a model size must be a whole number "
                                  "> 0; fix config.json (save_pretrained writes the model's own)")


def _build_on_meta(path: Path, transformers, model_cls) -> torch.nn.Module:
    _check_config_json(path)
    try:
        hf_config = transformers.AutoConfig.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - transformers' own checks of the user's file, raised as their kinds
        raise ConfigError(f"{path / 'config.json'}: transformers refuses it ({' '.join(str(exc).split())}); fix config.json "
                          "(save_pretrained writes the model's own)") from exc
    model_cls = model_cls if model_cls is not None else transformers.AutoModelForCausalLM
    # Auto classes build through from_config; a model class through _from_config, which is what
    # from_config calls (it also picks the attention implementation as from_pretrained does).
    build = getattr(model_cls, "from_config", None) or getattr(model_cls, "_from_config", None)
    if build is None:
        raise ConfigError(f"model_cls={model_cls!r} is not a transformers model class (it has no from_config)")
    try:
        with torch.device("meta"):
            return build(hf_config, dtype=torch.float32)
    except ValueError as exc:  # an Auto class that has no model for this config's model_type
        raise ConfigError(f"{path}: {getattr(model_cls, '__name__', model_cls)} cannot build this "
                          f"'{hf_config.model_type}' model ({_first_line(exc)}); pass model_cls=, the class to "
                          "build, e.g. transformers.AutoModel") from exc
    except (KeyError, TypeError, RuntimeError, ArithmeticError) as exc:  # a setting the model code cannot use
        raise ConfigError(f"{path / 'config.json'}: building {getattr(model_cls, '__name__', model_cls)} from it "
                          f"failed ({type(exc).__name__}: {_first_line(exc)}); fix config.json (save_pretrained "
                          "writes the model's own)") from exc


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


_STREAMED_LORA_INITS = (True, False, "gaussian")  # the ones peft's reset_lora_parameters runs, from no data
# peft's names for a base weight it wraps: q_proj.base_layer.weight, lm_head.original_module.weight, and
# the trained copy lm_head.modules_to_save.default.weight (all read from the checkpoint's <module>.weight)
_PEFT_WRAPPER_SEGMENT = re.compile(r"\.(base_layer|original_module|modules_to_save\.[^.]+)(?=\.)")


class _LoraAdapters:
    """[Note: LoRA on a streamed base] peft's LoRA adapters on the meta model: which tensors
    are adapters (in no checkpoint), the checkpoint name of a wrapped base weight, and peft's
    init run on an adapter module as it is materialized."""

    def __init__(self, model: torch.nn.Module, peft_config):
        try:
            import peft
            from peft.tuners.lora import LoraLayer
        except ImportError as exc:
            raise ConfigError(f"from_pretrained(..., peft_config=) needs peft ({exc}): pip install peft") from exc
        working_order = ("or load the model with transformers, apply peft.get_peft_model, then "
                         "zerotier.initialize(model, config) (the base is then in RAM once, while loading)")
        kind = getattr(peft_config, "peft_type", None)
        if kind != peft.PeftType.LORA:
            raise ConfigError(f"from_pretrained(..., peft_config=) streams the base under LoRA adapters "
                              f"(peft.LoraConfig); got {type(peft_config).__name__} ({kind}): {working_order}")
        self.init = peft_config.init_lora_weights
        if self.init not in _STREAMED_LORA_INITS or getattr(peft_config, "use_dora", False):
            what = "use_dora=True" if self.init in _STREAMED_LORA_INITS else f"init_lora_weights={self.init!r}"
            raise ConfigError(f"from_pretrained(..., peft_config=): {what} initializes the adapters from the base "
                              "weights, which are not in memory while they stream; use init_lora_weights=True, "
                              f"'gaussian' or False without DoRA, {working_order}")
        with torch.random.fork_rng(devices=[]):  # its meta build still draws embedding adapters (torch.randn)
            self.peft_model = peft.get_peft_model(model, peft_config, low_cpu_mem_usage=True)
        # the module owning each adapter tensor -> (its LoRA layer, adapter name, that layer's adapter tensors)
        self.layer_of: dict[int, tuple[torch.nn.Module, str, list[tuple[torch.nn.Module, str]]]] = {}
        self.tensor_ids: set[int] = set()
        self.rng: dict[tuple[int, str], torch.Tensor] = {}  # (id(layer), adapter) -> CPU stream state before its draws
        for layer in model.modules():
            if not isinstance(layer, LoraLayer):
                continue
            for adapter in layer.active_adapters:
                slots = []  # (owning module, parameter name)
                for attr in ("lora_A", "lora_B"):
                    if adapter in getattr(layer, attr):
                        slots += [(m, n) for m in getattr(layer, attr)[adapter].modules()
                                  for n, t in m._parameters.items() if t is not None]
                for attr in ("lora_embedding_A", "lora_embedding_B"):
                    if adapter in getattr(layer, attr):
                        slots.append((getattr(layer, attr), adapter))
                for owner, name in slots:
                    self.layer_of[id(owner)] = (layer, adapter, slots)
                    self.tensor_ids.add(id(owner._parameters[name]))
                # peft on a model in RAM draws each layer's adapters in this order from the global
                # stream: the stream's state before them is kept, and the stream advanced past them
                self.rng[(id(layer), adapter)] = torch.get_rng_state()
                self._draw(layer, adapter, slots, keep=None)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        return _PEFT_WRAPPER_SEGMENT.sub("", name)

    def fill(self, module: torch.nn.Module) -> None:
        """The draws of peft's update_layer for the layer of adapter module `module`, from the stream
        state peft would have drawn them from, setting `module`'s tensors only."""
        layer, adapter, slots = self.layer_of[id(module)]
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self.rng[(id(layer), adapter)])
            self._draw(layer, adapter, slots, keep=module)

    def _draw(self, layer, adapter: str, slots, keep) -> None:
        """[Note: LoRA on a streamed base] What peft's update_layer draws for `adapter` of `layer`, in its
        order: each adapter module's constructor init (nn.Linear's reset_parameters; torch.randn for
        embedding adapters), then reset_lora_parameters(adapter, init). The layer's tensors other than
        `keep`'s are CPU scratch during the call, so the stream advances as in peft's own draws: another
        adapter module of the layer may be placed already (a unit of its own under wrap=), a released
        view whose bytes are not to be written."""
        others = [(owner, name, owner._parameters[name]) for owner, name in slots if owner is not keep]
        try:
            for owner, name, p in others:
                owner._parameters[name] = torch.nn.Parameter(torch.empty_like(p, device="cpu"), p.requires_grad)
            with torch.no_grad():
                for attr in ("lora_A", "lora_B"):
                    if adapter in getattr(layer, attr):
                        for m in getattr(layer, attr)[adapter].modules():
                            if hasattr(m, "reset_parameters"):
                                m.reset_parameters()
                for attr in ("lora_embedding_A", "lora_embedding_B"):
                    if adapter in getattr(layer, attr):
                        getattr(layer, attr)[adapter].normal_()
                if self.init:
                    layer.reset_lora_parameters(adapter, self.init)
        finally:
            for owner, name, p in others:
                owner._parameters[name] = p


class _SafetensorsFiles:
    """The directory's safetensors files, memory-mapped: a tensor's bytes are read when asked for."""

    def __init__(self, path: Path, safe_open, safetensor_error):
        if (path / _INDEX).is_file():
            try:
                weight_map = json.loads((path / _INDEX).read_text())["weight_map"]
                if not all(isinstance(v, str) for v in weight_map.values()):
                    raise TypeError("a shard file name is not a string")
                names = sorted(set(weight_map.values()))
            except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
                raise ConfigError(f"{path / _INDEX}: not a safetensors index (a JSON object with a "
                                  f"'weight_map' of tensor name -> shard file): {exc}") from exc
            for name in names:
                if Path(name).name != name or name in ("", ".", ".."):  # nothing outside the directory is read
                    raise ConfigError(f"{path / _INDEX} lists the shard {name!r}, which is not a file name in {path}")
                if not (path / name).is_file():
                    raise ConfigError(f"{path / _INDEX} lists the shard '{name}', which is not in {path}")
        elif (path / _SINGLE).is_file():
            names = [_SINGLE]
        else:
            other = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
            hint = (f"; {', '.join(other)} is not read (a pickle): load it with transformers once and "
                    "save_pretrained(dir) writes safetensors") if other else ""
            raise ConfigError(f"{path}: no {_SINGLE} or {_INDEX} next to config.json{hint}")
        self._stack = contextlib.ExitStack()
        self.where: dict[str, object] = {}  # tensor name -> the open file holding it
        try:
            for name in names:
                try:
                    handle = self._stack.enter_context(safe_open(path / name, framework="pt"))
                except (safetensor_error, OSError) as exc:
                    raise ConfigError(f"{path / name}: not a readable safetensors file ({exc})") from exc
                for key in handle.keys():
                    if key in self.where:
                        raise ConfigError(f"{path}: tensor '{key}' is in more than one shard ({name} and another)")
                    self.where[key] = handle
        except BaseException:
            self._stack.close()
            raise
        self.path = path

    def shape(self, name: str) -> list[int]:
        return list(self.where[name].get_slice(name).get_shape())

    def read(self, name: str) -> torch.Tensor:
        return self.where[name].get_tensor(name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stack.close()


class _Loader:
    """Which file tensor fills each of the model's tensors (checked up front), and the init_fn
    that fills a module's tensors when the materializer allocates them."""

    def __init__(self, model: torch.nn.Module, files: _SafetensorsFiles, adapters: _LoraAdapters | None = None):
        self.model, self.files, self.adapters = model, files, adapters
        self.prefix = {id(m): f"{n}." if n else "" for n, m in model.named_modules()}
        self.non_persistent = {f"{n}.{b}" if n else b for n, m in model.named_modules()
                               for b in m._non_persistent_buffers_set}
        self.head: set[str] = set()  # a task model's head in the files, unread by its base model
        file_key = self._naming(set(files.where))
        self._untie_differing(file_key)
        tensors: dict[int, tuple[list[str], torch.Size]] = {}  # one entry per tensor, with all its names
        for name, t in [*model.named_parameters(remove_duplicate=False),
                        *model.named_buffers(remove_duplicate=False)]:
            if name not in self.non_persistent and not (adapters and id(t) in adapters.tensor_ids):
                tensors.setdefault(id(t), ([], t.shape))[0].append(name)
        self.source: dict[str, str] = {}  # model name (every alias) -> file tensor name
        self.filled: set[int] = set()     # ids of tensors filled already (tied, or placed with an earlier unit)
        used, missing, problems = set(), [], []
        for names, shape in tensors.values():
            found = [file_key(n) for n in names if file_key(n) in files.where]
            if not found:
                missing.append(names[0])
                continue
            used.update(found)
            self.source.update((n, found[0]) for n in names)
            if (in_file := files.shape(found[0])) != list(shape):
                problems.append(f"'{found[0]}' has shape {in_file} in the checkpoint but {list(shape)} in the model")
        unexpected = [k for k in sorted(files.where) if k not in used and not self._ignorable(k)]
        if unexpected:
            problems.insert(0, f"the checkpoint's tensors {_listed(unexpected)} are not in the model")
        if missing:
            problems.insert(0, f"the model's tensors {_listed(missing)} are not in the checkpoint")
        if problems:
            raise ConfigError(f"{files.path}: does not fit the {type(model).__name__} built from its config.json: "
                              + "; ".join(problems))

    def _untie_differing(self, file_key) -> None:
        """[Note: streamed pretrained loading] Tied names whose file tensors differ get their own
        Parameter (read once here to compare: only tied tensors, the embedding at most)."""
        names_of: dict[int, list[str]] = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            names_of.setdefault(id(p), []).append(name)
        tied_keys = getattr(self.model, "all_tied_weights_keys", None)
        for names in names_of.values():
            present = [n for n in names if file_key(n) in self.files.where]
            if len(present) < 2:
                continue
            kept = self.files.read(file_key(present[0]))
            for name in present[1:]:
                if torch.equal(self.files.read(file_key(name)), kept):
                    continue
                owner, _, attr = name.rpartition(".")
                module = self.model.get_submodule(owner)
                old = module._parameters[attr]
                module._parameters[attr] = torch.nn.Parameter(torch.empty_like(old, device="meta"),
                                                              requires_grad=old.requires_grad)
                if isinstance(tied_keys, dict):
                    tied_keys.pop(name, None)
                warnings.warn(f"{self.files.path}: {type(self.model).__name__} ties {name} to {present[0]}, but the "
                              "checkpoint holds both with different values: they are loaded untied, as transformers "
                              "does (set tie_word_embeddings=false in config.json if they are meant to differ)",
                              UserWarning, stacklevel=4)

    def _naming(self, file_names: set[str]):
        """model name -> file name. By the model's base_model_prefix, a base model's checkpoint
        loads into its task model and the reverse, as in transformers' loading."""
        prefix = getattr(self.model, "base_model_prefix", "") or ""
        peft_name = self.adapters.checkpoint_name if self.adapters else (lambda n: n)
        model_names = [peft_name(n) for n, _ in self.model.named_parameters(remove_duplicate=False)]
        under = f"{prefix}."
        if not prefix or any(n in file_names for n in model_names):
            return peft_name
        if any(n.startswith(under) for n in model_names) and not any(k.startswith(under) for k in file_names):
            return lambda n: peft_name(n).removeprefix(under)  # base model's checkpoint -> task model
        if any(k.startswith(under) for k in file_names):  # task model's checkpoint -> base model
            self.head = {k for k in file_names if not k.startswith(under)}
            return lambda n: under + peft_name(n)
        return peft_name

    def _ignorable(self, key: str) -> bool:
        patterns = [*(getattr(self.model, "_keys_to_ignore_on_load_unexpected", None) or ()),
                    *_COMPUTED_IN_OLD_FILES]
        return key in self.head or key in self.non_persistent or any(re.search(p, key) for p in patterns)

    def fill(self, module: torch.nn.Module) -> None:
        """init_fn for the materializer: `module`'s tensors not filled yet, from the files (a
        non-persistent buffer: computed by the model; an adapter: peft's init). [Note: streamed
        pretrained loading]"""
        if self.adapters and id(module) in self.adapters.layer_of:
            self.adapters.fill(module)
            return
        prefix = self.prefix[id(module)]
        computed = [(n, b) for n, b in module._buffers.items()
                    if b is not None and id(b) not in self.filled and n in module._non_persistent_buffers_set]
        if computed:
            self._compute(module, prefix, computed)
        tensors = [*module._parameters.items(), *module._buffers.items()]
        for n, t in tensors:
            if t is not None and id(t) not in self.filled:
                t.copy_(self.files.read(self.source[prefix + n]))
                self.filled.add(id(t))

    def _compute(self, module, prefix: str, computed: list[tuple[str, torch.Tensor]]) -> None:
        init_weights = getattr(self.model, "_init_weights", None)
        for _, b in computed:
            b.fill_(_sentinel(b))
        # [Note: streamed pretrained loading] transformers' init functions skip tensors flagged
        # _is_hf_initialized: everything else of the module is left alone (or copied below).
        others = [t for t in (*module._parameters.values(), *module._buffers.values())
                  if t is not None and all(t is not b for _, b in computed) and not hasattr(t, "_is_hf_initialized")]
        for t in others:
            t._is_hf_initialized = True
        try:
            if init_weights is not None:
                init_weights(module)
        finally:
            for t in others:
                del t._is_hf_initialized
        unset = [prefix + n for n, b in computed if _unset(b)]
        if unset:
            model = type(self.model).__name__
            raise ConfigError(f"{', '.join(unset)}: non-persistent buffers that {model}._init_weights(module) "
                              "does not set; they are in no checkpoint, so zerotier cannot fill them"
                              + ("" if init_weights is not None else f" ({model} has no _init_weights)"))
        self.filled.update(id(b) for _, b in computed)


def _sentinel(t: torch.Tensor):
    """What a computed buffer holds before the model computes it (bool: nothing to tell apart)."""
    if t.is_floating_point() or t.is_complex():
        return float("nan")
    return torch.iinfo(t.dtype).min if t.dtype != torch.bool else False


def _unset(t: torch.Tensor) -> bool:
    if t.is_floating_point() or t.is_complex():
        return bool(t.isnan().any())
    return t.dtype != torch.bool and bool((t == _sentinel(t)).any())


def _listed(names: list[str], most: int = 8) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")
