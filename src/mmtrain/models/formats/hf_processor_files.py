"""The files beside a Hugging Face folder's weights that its users need to run it: the
tokenizer, the chat template, the image / video processor, the generation defaults.

A HF folder or an mmtrain model folder converted from one holds them (PROCESSOR_FILES); a run
folder (`mmtrain train`'s OUT) holds them when the trainer copied them there at start
(`train/export.py`), else they are where the run started: `processor_files_of_run` looks, in
order, in the run folder, in its `init` folder (of a `{tower: path}` init, the `text` tower's
first), then in `data.tokenizer`'s folder, as the run's config.yaml records them. Each group
of files (tokenizer with its chat template, processor configs, generation config) comes whole
from the first folder holding any of it, so a tokenizer.json never meets another folder's
tokenizer_config.json. A chat template the run was trained with (`data.chat_template` naming a
file or folder) is the export's `chat_template.jinja`, which transformers prefers to a
tokenizer_config.json's.

Paths recorded in config.yaml are read as written when absolute; a relative one against the
run folder's parent, then the working directory. A path recorded but found nowhere is an error
naming config.yaml and the field. transformers is not imported here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmtrain import folders
from mmtrain.hf_chat_template import stored_chat_template
from mmtrain.models.formats.hf_common import HFFolderError, read_json

log = logging.getLogger(__name__)

# A tokenizer_config.json may hold the chat template itself: template files travel with it.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "chat_template.json",
                   "chat_template.jinja")  # fmt: skip
PROCESSOR_CONFIG_FILES = ("preprocessor_config.json", "video_preprocessor_config.json",
                          "processor_config.json")  # fmt: skip
GENERATION_FILES = ("generation_config.json",)
GROUPS = {"tokenizer": TOKENIZER_FILES, "processor": PROCESSOR_CONFIG_FILES,
          "generation": GENERATION_FILES}  # fmt: skip
# Every one of them, in the order the commands list what they copied.
PROCESSOR_FILES = TOKENIZER_FILES + PROCESSOR_CONFIG_FILES + GENERATION_FILES
CHAT_TEMPLATE_FILE = "chat_template.jinja"
TEXT_TOWER = "text"  # whose init folder holds the tokenizer of a {tower: path} init
# An init that names a weights file (an OpenCLIP checkpoint) has no processor files beside it.
WEIGHTS_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".ckpt")

Locate = Callable[[str, str], Path]  # (recorded value, its config field) -> an existing path


# Processor files that cannot be read, found or do not fit the model: files of a HF folder,
# refused as any other (the message names the file and, where one is to blame, the field).
ProcessorFilesError = HFFolderError


@dataclass
class ProcessorFiles:
    """What an export carries beside its weights: `files` (name in the export -> the file it
    is copied from), `texts` (name -> content written, the chat template the run trained with)
    and `notes` for the user (a template that differs, a resized vocabulary)."""

    files: dict[str, Path] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    trained_tokenizer: Path | None = None  # data.tokenizer's tokenizer.json, to compare

    def names(self) -> list[str]:
        return [name for name in PROCESSOR_FILES if name in self.files or name in self.texts]

    def by_source(self) -> dict[str, list[str]]:
        """{folder (or file) copied from: names}, for the command's summary."""
        out: dict[str, list[str]] = {}
        for name, path in self.files.items():
            out.setdefault(str(path.parent), []).append(name)
        for name in self.texts:
            out.setdefault("data.chat_template", []).append(name)
        return out

    def write(self, out: Path) -> list[str]:
        """Copy and write them into `out`, each atomically; their names."""
        from mmtrain.atomic import atomic_write_bytes, atomic_write_text

        for name, path in self.files.items():
            if name not in self.texts:
                atomic_write_bytes(out / name, path.read_bytes())
        for name, text in self.texts.items():
            atomic_write_text(out / name, text)
        return self.names()


# ----------------------------------------------------------------------------- finding them
def folder_processor_files(folder: Path) -> ProcessorFiles:
    """The PROCESSOR_FILES a HF or mmtrain model folder holds."""
    return ProcessorFiles({n: folder / n for n in PROCESSOR_FILES if (folder / n).is_file()})


def processor_files_of_run(run_dir: Path) -> ProcessorFiles:
    """The processor files of a run folder: its own, else those of where it started, as its
    config.yaml records `init`, `data.tokenizer` and `data.chat_template`."""
    config_file = run_dir / folders.CONFIG_FILE
    config = _read_run_config(config_file)
    data = config.get("data") if isinstance(config.get("data"), dict) else {}

    def locate(value: str, key: str) -> Path:
        return locate_recorded(value, key, config_file)

    def text(value: Any) -> str | None:
        return value if isinstance(value, str) else None

    return find_processor_files(
        run_dir, config.get("init"), text(data.get("tokenizer")), text(data.get("chat_template")),
        locate,
    )  # fmt: skip


def find_processor_files(
    own: Path | None,
    init: str | Mapping[str, str] | None,
    tokenizer: str | None,
    chat_template: str | None,
    locate: Locate,
) -> ProcessorFiles:
    """Each group of files from the first folder holding any of it: `own`, then `init`'s
    folders, then `tokenizer`'s; then the chat template the run trained with. A recorded
    folder that is nowhere is an error while the tokenizer is still missing, a note after."""
    found = ProcessorFiles()
    missing = dict(GROUPS)
    origin: dict[str, Path] = {}  # group -> the folder it came from
    lost: list[ProcessorFilesError] = []  # in the order of the folders looked in
    lost_tokenizer: list[ProcessorFilesError] = []
    trained = None  # data.tokenizer's path
    if tokenizer and _is_path_tokenizer(tokenizer):
        trained = _try_locate(tokenizer, "data.tokenizer", locate, lost_tokenizer)
    for folder in _candidate_folders(own, init, trained, locate, lost):
        for group, names in list(missing.items()):
            present = [name for name in names if (folder / name).is_file()]
            if present:
                found.files.update({name: folder / name for name in present})
                origin[group] = folder
                del missing[group]
        if not missing:
            break
    if "tokenizer" in missing and trained is not None and _tokenizer_json(trained) == trained:
        found.files["tokenizer.json"] = trained  # a tokenizer.json by another name
        origin["tokenizer"] = trained.parent
    lost += lost_tokenizer
    if lost and "tokenizer" not in origin:
        raise lost[0]
    found.notes += [f"{err}; the export goes on without it" for err in lost]
    if own is not None and origin.get("tokenizer") == own:
        return found  # the run folder's own tokenizer and template are the run's
    if trained is not None:
        found.trained_tokenizer = _tokenizer_json(trained)
    elif tokenizer and not _is_path_tokenizer(tokenizer) and "tokenizer.json" in found.files:
        found.notes.append(
            f"the run trained with data.tokenizer {tokenizer!r}; the export carries "
            f"{found.files['tokenizer.json']}, whose ids the model did not learn"
        )
    _add_trained_template(found, chat_template, origin.get("tokenizer"), locate)
    return found


def _try_locate(
    value: str, key: str, locate: Locate, lost: list[ProcessorFilesError]
) -> Path | None:
    try:
        return locate(value, key)
    except ProcessorFilesError as err:
        lost.append(err)
        return None


def _candidate_folders(
    own: Path | None,
    init: Any,
    trained: Path | None,
    locate: Locate,
    lost: list[ProcessorFilesError],
) -> Iterator[Path]:
    """The folders to look in, in order, each init folder located only when the folders
    before it did not hold every group (those found nowhere are appended to `lost`)."""
    if own is not None:
        yield own
    if isinstance(init, str):
        inits = [("init", init)]
    elif isinstance(init, Mapping):
        towers = sorted(init, key=lambda tower: tower != TEXT_TOWER)  # the text tower first
        inits = [(f"init.{tower}", init[tower]) for tower in towers if isinstance(init[tower], str)]
    else:
        inits = []
    for key, value in inits:
        if Path(value).suffix in WEIGHTS_SUFFIXES:
            continue
        path = _try_locate(value, key, locate, lost)
        if path is not None and path.is_dir():
            yield path
    if trained is not None:
        yield trained if trained.is_dir() else trained.parent


def _is_path_tokenizer(value: str) -> bool:
    return value.lower() != "byte"


def _tokenizer_json(path: Path) -> Path | None:
    if path.is_dir():
        path = path / "tokenizer.json"
    return path if path.is_file() and path.suffix == ".json" else None


def _add_trained_template(
    found: ProcessorFiles,
    chat_template: str | None,
    tokenizer_folder: Path | None,
    locate: Locate,
) -> None:
    """The chat template the run trained with, when `data.chat_template` names a file or
    folder other than the one the tokenizer came from."""
    from mmtrain.data.stream.chat_templates import TEMPLATES

    if not chat_template:
        return
    has_template = any(
        name in found.files for name in ("chat_template.jinja", "chat_template.json")
    )
    has_template = has_template or _config_has_template(found.files.get("tokenizer_config.json"))
    if chat_template in TEMPLATES:
        if has_template:
            found.notes.append(
                f"the run trained with the named template {chat_template!r}; the export "
                f"carries {tokenizer_folder}'s own chat template, which transformers applies"
            )
        else:
            found.notes.append(
                f"the run trained with the named template {chat_template!r}, which has no "
                "Jinja form: the export has no chat template for apply_chat_template"
            )
        return
    path = locate(chat_template, "data.chat_template")
    folder = path if path.is_dir() else path.parent
    if tokenizer_folder is not None and folder.resolve() == tokenizer_folder.resolve():
        return
    found.texts[CHAT_TEMPLATE_FILE] = _template_text(path)


def _config_has_template(path: Path | None) -> bool:
    return path is not None and stored_chat_template(read_json(path)) is not None


def _template_text(path: Path) -> str:
    """The Jinja source of a .jinja file, or of a folder's chat_template.jinja, else of a
    tokenizer_config.json's `chat_template` (a string, or the one named `default`)."""
    jinja = path if path.suffix == ".jinja" else path / CHAT_TEMPLATE_FILE
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    config = path if path.suffix == ".json" else path / "tokenizer_config.json"
    value = stored_chat_template(read_json(config)) if config.is_file() else None
    if value is None:
        raise ProcessorFilesError(
            path, "holds no chat template (no chat_template.jinja, no tokenizer_config.json "
            "with a 'chat_template')", "data.chat_template",
        )  # fmt: skip
    return value


# ----------------------------------------------------------------------------- recorded paths
def locate_recorded(value: str, key: str, config_file: Path) -> Path:
    """A path config.yaml recorded: as written when absolute; a relative one against the run
    folder's parent, then the working directory. ProcessorFilesError when it is nowhere."""
    path = Path(value).expanduser()
    tried = [path] if path.is_absolute() else [config_file.parent.parent / path, Path.cwd() / path]
    for candidate in tried:
        if candidate.exists():
            return candidate.resolve()
    raise ProcessorFilesError(
        config_file,
        f"{value!r} is not found (looked at {', '.join(str(p) for p in tried)}); the export "
        "takes the tokenizer, chat template and processor files from there: put the folder "
        f"back, or copy its files into {config_file.parent}",
        key,
    )


def _read_run_config(path: Path) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except OSError as err:
        raise ProcessorFilesError(path, f"cannot be read: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ProcessorFilesError(path, f"is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ProcessorFilesError(path, "is not a run config (a mapping)")
    return data


# ----------------------------------------------------------------------------- the vocabulary
def check_vocabulary(found: ProcessorFiles, vocab_size: int | None) -> None:
    """Refuse a tokenizer that has ids past the model's embedding, or that is not the one the
    run trained with (`data.tokenizer`); note a vocabulary resized since the tokenizer's
    folder was saved (ids past the tokenizer's have no token)."""
    tokens = tokenizer_vocab(found.files)
    if tokens is None or vocab_size is None:
        return
    source = found.files.get("tokenizer.json") or found.files.get("vocab.json")
    count = max(tokens.values(), default=-1) + 1
    if count > vocab_size:
        raise ProcessorFilesError(
            source,
            f"the tokenizer has {count} tokens but the model's vocab_size {vocab_size}: ids "
            f"{vocab_size}..{count - 1} have no embedding; export with the tokenizer the run "
            "trained with (copy its files into the run folder)",
        )
    trained = found.trained_tokenizer
    exported = found.files.get("tokenizer.json")
    if trained is not None and exported is not None and exported.resolve() != trained.resolve():
        _check_same_tokenizer(exported, trained)
    resized_from = _saved_vocab_size(source.parent)
    if count < vocab_size and resized_from not in (None, vocab_size):
        found.notes.append(
            f"the model's vocabulary was resized from {resized_from} ({source.parent}) to "
            f"{vocab_size}; the tokenizer names {count} ids, so ids {count}..{vocab_size - 1} "
            "have no token"
        )


def _check_same_tokenizer(exported: Path, trained: Path) -> None:
    """The two tokenizer.json files give every token the same id (what mmtrain reads of a
    tokenizer is its tokenizer.json)."""
    ours = tokenizer_vocab({"tokenizer.json": exported}) or {}
    theirs = tokenizer_vocab({"tokenizer.json": trained}) or {}
    differ = sorted(t for t in set(ours) | set(theirs) if ours.get(t) != theirs.get(t))
    if differ:
        raise ProcessorFilesError(
            exported,
            f"is not the tokenizer the run trained with (data.tokenizer {trained}): "
            f"{len(differ)} tokens differ, e.g. {differ[:3]}; copy the tokenizer files the run "
            "trained with into the run folder",
        )


def tokenizer_vocab(files: Mapping[str, Path]) -> dict[str, int] | None:
    """{token: id} of the tokenizer in `files` (tokenizer.json, else vocab.json), added tokens
    included (added_tokens.json, tokenizer_config.json's added_tokens_decoder); None without
    one."""
    if "tokenizer.json" in files:
        from tokenizers import Tokenizer

        try:
            tokens = Tokenizer.from_file(str(files["tokenizer.json"])).get_vocab(True)
        except Exception as err:  # the library raises a bare Exception for a bad file
            raise ProcessorFilesError(
                files["tokenizer.json"], f"is not a tokenizer: {err}"
            ) from None
    elif "vocab.json" in files:
        tokens = {str(k): int(v) for k, v in read_json(files["vocab.json"]).items()}
    else:
        return None
    if "added_tokens.json" in files:
        tokens.update({str(k): int(v) for k, v in read_json(files["added_tokens.json"]).items()})
    if "tokenizer_config.json" in files:
        decoder = read_json(files["tokenizer_config.json"]).get("added_tokens_decoder") or {}
        for index, token in decoder.items() if isinstance(decoder, dict) else ():
            if isinstance(token, dict) and isinstance(token.get("content"), str):
                tokens[token["content"]] = int(index)
    return tokens


def _saved_vocab_size(folder: Path) -> int | None:
    """vocab_size of the config.json beside a tokenizer (top level or `text_config`)."""
    path = folder / "config.json"
    if not path.is_file():
        return None
    config = read_json(path)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    value = config.get("vocab_size", text.get("vocab_size"))
    return value if isinstance(value, int) else None
