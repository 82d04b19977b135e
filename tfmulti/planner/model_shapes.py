"""A model given by its shape, not by a model to time: per-layer matmuls, bytes and parameters.

Pure Python. `scripts/plan.py --model_shape` takes either a GPT
(`gpt:layers=L,hidden=H,heads=A,seq=S,vocab=V[,microbatch=b]`, laid out as Megatron-LM
lays it out: an embedding, L Transformer layers, a tied output layer) or a JSON file of
layers (`layers:path.json`) for any other model:

    {"format": "tfmulti.planner.layers/1", "name": "my model", "layers": [
      {"name": "block", "params": 1000000, "replicated_params": 0,
       "matmuls": [{"m": 2048, "k": 1024, "n": 4096, "batch": 1, "split": "n",
                    "weight": true}],
       "elementwise_bytes": 8e6, "elementwise_split_bytes": 0,
       "activation_bytes": 4e7, "activation_split_bytes": 0, "input_bytes": 4e6,
       "tensor_allreduces": 1, "backward_tensor_allreduces": 1, "recomputed": true}]}

Sizes are per example (one sequence) of the forward pass; `*_split_bytes` and `split`
matmuls divide over a tensor group, the rest every device of the group holds or runs.

The GPT's figures, 16-bit activations and Megatron's fused kernels, no sequence
parallelism (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models", 2022, section 4): a layer keeps s·h·(10 + 24/t) + 5·a·s²/t bytes for its backward
(or only its 2·s·h input with full recomputation); its element-wise kernels read and write
22·s·h bytes on every device of a tensor group (two layer norms 4+4, two fused
bias-dropout-adds 7+7) and 16·s·h/t + 9·a·s²/t split (bias-GeLU 16, softmax 4 and its
dropout 5 per score).
"""

from __future__ import annotations

import dataclasses
import json

LAYERS_FILE_FORMAT = "tfmulti.planner.layers/1"
MATMUL_SPLITS = ("n", "k", "batch", "none")
GPT_FIELDS = ("layers", "hidden", "heads", "seq", "vocab")
# 16-bit activations and weights.
ELEMENT_BYTES = 2


@dataclasses.dataclass(frozen=True)
class Matmul:
    """`batch` products of an (m x k) by a (k x n) matrix in one example's forward pass.

    Args:
        m, k, n: the product's sizes.
        batch: products per example (attention heads for attention's two).
        split: the size a tensor group divides: "n" (column-parallel), "k" (row-parallel,
            its outputs summed by an all-reduce), "batch" (heads), or "none".
        weight: the (k x n) operand is a weight, read once per micro-batch; False: both
            operands are activations of each example.
    """

    m: int
    k: int
    n: int
    batch: int = 1
    split: str = "n"
    weight: bool = True

    def __post_init__(self):
        if self.split not in MATMUL_SPLITS:
            raise ValueError(
                f"A matmul's split is one of {MATMUL_SPLITS}. Received: split={self.split!r}"
            )
        for field in ("m", "k", "n", "batch"):
            _check_positive_int(f"matmul {field}", getattr(self, field))

    @property
    def flops(self) -> float:
        """Forward FLOPs per example: 2·batch·m·k·n."""
        return 2.0 * self.batch * self.m * self.k * self.n


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One layer's forward pass per example, and what it holds.

    Args:
        name: for reports.
        params: parameters a tensor group splits.
        replicated_params: parameters every device of a tensor group holds.
        matmuls: its matrix multiplications.
        elementwise_bytes: bytes its element-wise kernels read and write on every device
            of a tensor group.
        elementwise_split_bytes: the same, divided over the tensor group.
        activation_bytes: bytes kept for the backward without recomputation, on every
            device of a tensor group.
        activation_split_bytes: the same, divided over the tensor group.
        input_bytes: its input's bytes: all it keeps with full recomputation, and what a
            stage boundary before it sends.
        tensor_allreduces: all-reduces of an input-sized tensor in its forward when split
            over a tensor group.
        backward_tensor_allreduces: the same in its backward.
        recomputed: full activation recomputation runs its forward again in the backward.
    """

    name: str
    params: int
    replicated_params: int = 0
    matmuls: tuple[Matmul, ...] = ()
    elementwise_bytes: float = 0.0
    elementwise_split_bytes: float = 0.0
    activation_bytes: float = 0.0
    activation_split_bytes: float = 0.0
    input_bytes: float = 0.0
    tensor_allreduces: int = 0
    backward_tensor_allreduces: int = 0
    recomputed: bool = True

    @property
    def forward_flops(self) -> float:
        """Forward matmul FLOPs per example."""
        return sum(matmul.flops for matmul in self.matmuls)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A model as layers, in order, and the micro-batch size it must run at, if any.

    Args:
        name: what the model is.
        layers: its layers; pipeline stages split between them.
        microbatch_size: the only micro-batch size to plan for, or None to search.
        gpt: the GPT's sizes when it is one (for Megatron's FLOPs count), else None.
    """

    name: str
    layers: tuple[LayerSpec, ...]
    microbatch_size: int | None = None
    gpt: dict | None = None

    @property
    def num_params(self) -> int:
        return sum(layer.params + layer.replicated_params for layer in self.layers)

    @property
    def repeated_layers(self) -> int:
        """Layers a pipeline divides evenly: all but a GPT's embedding and output layer."""
        return self.gpt["layers"] if self.gpt else len(self.layers)

    def model_flops(self, batch: int, recompute: bool) -> float:
        """FLOPs of one step of `batch` examples as Megatron-LM counts them: forward,
        backward (twice the forward) and, with recomputation, the recomputed forward of
        the layers recomputation covers; matmuls only."""
        return batch * sum(
            (4 if recompute and layer.recomputed else 3) * layer.forward_flops
            for layer in self.layers
        )


def megatron_flops(
    batch: int, seq: int, layers: int, hidden: int, vocab: int, recompute: bool = True
) -> float:
    """Megatron-LM's FLOPs per iteration (Narayanan et al., SC'21, section 5.1):
    96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) with full recomputation, 72·... without (the
    logits term is then 6·B·s·h·V, not recomputed).

    Example:
        >>> f"{megatron_flops(512, 2048, 24, 2304, 51200):.4e}"
        '1.5467e+16'
    """
    per_layer = (
        (96 if recompute else 72) * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden))
    )
    return per_layer + 6.0 * batch * seq * hidden * vocab


def gpt_shape(
    layers: int, hidden: int, heads: int, seq: int, vocab: int, microbatch: int | None = None
) -> ModelShape:
    """A GPT as Megatron-LM lays it out: embedding, `layers` Transformer layers, output layer."""
    for name, value in (
        ("layers", layers),
        ("hidden", hidden),
        ("heads", heads),
        ("seq", seq),
        ("vocab", vocab),
    ):
        _check_positive_int(f"model_shape field {name}", value)
    if microbatch is not None:
        _check_positive_int("model_shape field microbatch", microbatch)
    if hidden % heads:
        raise ValueError(
            f"model_shape field heads must divide hidden. Received: heads={heads}, hidden={hidden}"
        )
    h, s, a = hidden, seq, heads
    sh = s * h
    embedding = LayerSpec(
        name="embedding",
        params=vocab * h,
        replicated_params=s * h,
        elementwise_bytes=3 * ELEMENT_BYTES * sh,
        tensor_allreduces=1,
    )
    transformer = LayerSpec(
        name="transformer",
        params=12 * h * h + 7 * h,
        replicated_params=6 * h,
        matmuls=(
            Matmul(s, h, 3 * h, split="n"),
            Matmul(s, h // a, s, batch=a, split="batch", weight=False),
            Matmul(s, s, h // a, batch=a, split="batch", weight=False),
            Matmul(s, h, h, split="k"),
            Matmul(s, h, 4 * h, split="n"),
            Matmul(s, 4 * h, h, split="k"),
        ),
        elementwise_bytes=22 * sh,
        elementwise_split_bytes=16 * sh + 9 * a * s * s,
        activation_bytes=10 * sh,
        activation_split_bytes=24 * sh + 5 * a * s * s,
        input_bytes=ELEMENT_BYTES * sh,
        tensor_allreduces=2,
        backward_tensor_allreduces=2,
    )
    # The output layer reuses the embedding's weights; its logits' float32 softmax and
    # cross-entropy read and write 4 bytes a logit, and keep them for the backward.
    output = LayerSpec(
        name="output",
        params=0,
        replicated_params=2 * h,
        matmuls=(Matmul(s, h, vocab, split="n"),),
        elementwise_bytes=8 * sh,
        elementwise_split_bytes=12 * s * vocab,
        activation_bytes=ELEMENT_BYTES * sh,
        activation_split_bytes=4 * s * vocab,
        input_bytes=ELEMENT_BYTES * sh,
        backward_tensor_allreduces=1,
        recomputed=False,
    )
    return ModelShape(
        name=f"gpt(layers={layers},hidden={hidden},heads={heads},seq={seq},vocab={vocab})",
        layers=(embedding, *([transformer] * layers), output),
        microbatch_size=microbatch,
        gpt={"layers": layers, "hidden": hidden, "heads": heads, "seq": seq, "vocab": vocab},
    )


def parse_model_shape(text: str) -> ModelShape:
    """`gpt:layers=L,hidden=H,heads=A,seq=S,vocab=V[,microbatch=b]` or `layers:path.json`.

    Example:
        >>> parse_model_shape("gpt:layers=2,hidden=64,heads=4,seq=16,vocab=100").gpt["heads"]
        4
    """
    kind, _, rest = text.partition(":")
    if kind == "layers":
        return load_layers(rest)
    if kind != "gpt":
        raise ValueError(
            "--model_shape is gpt:layers=L,hidden=H,heads=A,seq=S,vocab=V or layers:path.json. "
            f"Received: --model_shape={text}"
        )
    fields = {}
    for item in filter(None, rest.split(",")):
        name, equals, value = item.partition("=")
        if name not in (*GPT_FIELDS, "microbatch") or not equals:
            raise ValueError(
                f"Unknown model_shape field {name!r}: a gpt takes {', '.join(GPT_FIELDS)} and "
                f"optionally microbatch, as name=integer. Received: {item}"
            )
        if not value.isdigit():
            raise ValueError(f"model_shape field {name} must be an integer >= 1. Received: {item}")
        fields[name] = int(value)
    missing = [name for name in GPT_FIELDS if name not in fields]
    if missing:
        raise ValueError(
            f"model_shape field {missing[0]} is missing: a gpt needs {', '.join(GPT_FIELDS)}. "
            f"Received: --model_shape={text}"
        )
    return gpt_shape(**fields)


def load_layers(path: str) -> ModelShape:
    """The model of a layers file (`LAYERS_FILE_FORMAT`)."""
    try:
        with open(path) as file:
            data = json.load(file)
    except OSError as error:
        raise ValueError(f"Cannot read layers file {path}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"Layers file {path} is not JSON: {error}") from None
    return layers_from_json(data)


def layers_from_json(data: dict) -> ModelShape:
    """Reads a layers file's JSON object; errors name the missing or bad field."""
    if not isinstance(data, dict) or data.get("format") != LAYERS_FILE_FORMAT:
        raise ValueError(
            f"A layers file starts with format {LAYERS_FILE_FORMAT!r}. Received: {str(data)[:80]}"
        )
    if not data.get("layers"):
        raise ValueError("Layers file field layers is missing or empty. Received: layers=[]")
    layers = []
    names = {field.name for field in dataclasses.fields(LayerSpec)}
    for index, layer in enumerate(data["layers"]):
        unknown = sorted(set(layer) - names)
        if unknown or "params" not in layer:
            field = unknown[0] if unknown else "params"
            raise ValueError(
                f"Layers file field layers[{index}].{field} is "
                f"{'unknown' if unknown else 'missing'}. Expected fields: {sorted(names)}"
            )
        try:
            matmuls = tuple(Matmul(**matmul) for matmul in layer.get("matmuls", ()))
        except TypeError as error:
            raise ValueError(f"Layers file field layers[{index}].matmuls: {error}") from None
        layers.append(
            LayerSpec(
                **{**layer, "name": str(layer.get("name", f"layer{index}")), "matmuls": matmuls}
            )
        )
    return ModelShape(name=str(data.get("name", "layers")), layers=tuple(layers))


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1. Received: {value!r}")
