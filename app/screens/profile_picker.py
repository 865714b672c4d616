"""The profile picker: presets and the user's saved profiles with their values, editable fields validated inline
by ``SamplingProfile`` itself (its errors name the field, the value and the range), save-as and delete."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Button, Input, OptionList, Static
from textual.widgets.option_list import Option

from mlxchat.core.sampling.profile import ProfileError, ProfileStore, SamplingProfile
from mlxchat.core.sampling.sampler_params import PARAMS

from ..formatting import profile_summary
from .dialogs import TextPrompt

# The fields offered for editing, in the order shown: every sampler parameter with its hint
# (core/sampling/sampler_params.py), then the request's own settings.
FIELDS: list[tuple[str, str]] = [
    *((p.name, p.hint) for p in PARAMS.values()),
    ("max_tokens", "empty = no limit"),
    ("seed", "empty = random"),
    ("stop", 'e.g. ["\\n\\n"]'),
    ("response_format", 'JSON, e.g. {"type": "json_object"}; empty = text'),
]
OPTIONAL = {"seed", "max_tokens"}
# JSON lists of strings (one plain string is a list of one)
LISTS = {"stop", *(p.name for p in PARAMS.values() if p.type is list)}


@dataclass(frozen=True)
class ProfileEntry:
    key: str  # "preset:chat" / "user:mine"
    kind: str
    profile: SamplingProfile | None
    error: str | None = None


def load_entries(store: ProfileStore) -> list[ProfileEntry]:
    entries = [ProfileEntry(f"preset:{n}", "preset", SamplingProfile.preset(n)) for n in SamplingProfile.presets()]
    for name in store.list():
        try:
            entries.append(ProfileEntry(f"user:{name}", "user", store.load(name)))
        except ProfileError as e:
            entries.append(ProfileEntry(f"user:{name}", "user", None, str(e)))
    return entries


def field_text(profile: SamplingProfile, name: str) -> str:
    value = getattr(profile, name)
    if value is None:
        return ""
    if name in LISTS:
        return json.dumps(value) if value else ""
    if name == "response_format":
        return json.dumps(value.model_dump(mode="json", exclude_none=True))
    return f"{value:g}" if isinstance(value, float) else str(value)


def parse_field(name: str, text: str) -> Any:
    text = text.strip()
    if name in LISTS:
        if not text:
            return PARAMS[name].defaults() if name in PARAMS else []
        if text.startswith("["):
            try:
                return json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{name}: not a JSON list ({e.msg})") from None
        return [text]
    if name == "response_format":  # OpenAI's shape as JSON (core/sampling/response_format.py)
        try:
            return json.loads(text) if text else None
        except json.JSONDecodeError as e:
            raise ValueError(f"response_format: not JSON ({e.msg})") from None
    if name in OPTIONAL and not text:
        return None
    return text  # pydantic turns "0.8" into 0.8 and says what is wrong otherwise


def error_text(error: dict[str, Any]) -> str:
    field = ".".join(str(p) for p in error["loc"])
    # These messages name their field themselves (a response format's names the part: response_format.regex).
    own = ("out_of_range", "bad_name", "empty_stop", "bad_format", "bad_schema", "beam_format", "bad_breakers")
    return error["msg"] if error["type"] in own else f"{field}: {error['msg']}"


class ProfilePicker(ModalScreen[SamplingProfile | None]):
    """Returns the chosen (possibly edited) profile, or None."""

    BINDINGS = [
        Binding("escape", "cancel", "Cancel", id="profile_cancel"),
        Binding("ctrl+s", "save_as", "Save as…", id="profile_save"),
        Binding("ctrl+d", "delete_profile", "Delete user profile", id="profile_delete", show=False),
    ]

    def __init__(self, store: ProfileStore, current: SamplingProfile) -> None:
        super().__init__(classes="dialog-screen")
        self.store = store
        self.current = current
        self.entries: list[ProfileEntry] = []
        self.base: SamplingProfile = current
        self.edited: SamplingProfile | None = current
        self.errors: dict[str, str] = {}

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog profiles"):
            yield Static("Sampling profile", classes="dialog-title")
            with Horizontal(id="profile-body"):
                yield OptionList(id="profile-list")
                # Not a focus stop of its own (an invisible one, between the list and the first field): Tab goes
                # from the list to the fields.
                with VerticalScroll(id="profile-form", can_focus=False):
                    yield Static("", id="profile-description", markup=False)
                    with Vertical(id="profile-fields"):
                        for name, hint in FIELDS:
                            with Horizontal(classes="field-row"):
                                yield Static(name, classes="field-label")
                                yield Input(id=f"field-{name}", placeholder=hint, compact=True)
                            yield Static("", id=f"error-{name}", classes="field-error", markup=False)
                    yield Static("", id="profile-chain", markup=False)
                    yield Static("", id="profile-warnings", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button("Use", variant="primary", id="profile-use")
                yield Button("Save as…", id="profile-save")
                yield Button("Cancel", id="profile-cancel")

    def on_mount(self) -> None:
        self.refresh_entries(select=self._key_of(self.current))
        self.load_form(self.current)

    def _key_of(self, profile: SamplingProfile) -> str | None:
        if profile.name in SamplingProfile.presets():
            return f"preset:{profile.name}"
        if profile.name in self.store.list():
            return f"user:{profile.name}"
        return None

    def refresh_entries(self, select: str | None = None) -> None:
        self.entries = load_entries(self.store)
        options = self.query_one("#profile-list", OptionList)
        options.clear_options()
        for e in self.entries:
            name = e.key.split(":", 1)[1]
            detail = profile_summary(e.profile) if e.profile else (e.error or "")
            options.add_option(Option(Content.assemble((f"{e.kind:<6} ", "dim"), (name, "bold"), "\n  ", detail),
                                      id=e.key))
        if select is not None:
            try:
                options.highlighted = options.get_option_index(select)
            except Exception:  # noqa: BLE001
                pass

    # --- the form ------------------------------------------------------------------------------------------------

    def load_form(self, profile: SamplingProfile) -> None:
        self.base = profile
        for name, _ in FIELDS:
            self.query_one(f"#field-{name}", Input).value = field_text(profile, name)
        self.validate_form()

    def form_values(self) -> dict[str, Any]:
        return {name: self.query_one(f"#field-{name}", Input).value for name, _ in FIELDS}

    def validate_form(self) -> SamplingProfile | None:
        """Check every field at once: each field's error next to it (a field that does not parse keeps the base's
        value for the check, so the others are still checked), errors between fields under the form."""
        data = self.base.model_dump(mode="python")
        self.errors = {}
        for name, text in self.form_values().items():
            try:
                data[name] = parse_field(name, text)
            except ValueError as e:
                self.errors[name] = str(e)
        profile = None
        general: list[str] = []
        try:
            profile = SamplingProfile.model_validate(data)
        except ValidationError as e:
            for err in e.errors():
                if err["loc"]:
                    self.errors.setdefault(str(err["loc"][0]), error_text(err))
                else:
                    general.append(err["msg"].removeprefix("Value error, "))
        if self.errors:
            profile = None
        for name, _ in FIELDS:
            error = self.query_one(f"#error-{name}", Static)
            error.update(self.errors.get(name, ""))
            self.query_one(f"#field-{name}", Input).set_class(name in self.errors, "-invalid")
        if profile is not None and profile.model_dump() != self.base.model_dump():
            profile = SamplingProfile.model_validate({**profile.model_dump(), "name": self._edited_name(),
                                                      "description": self._edited_description()})
        self.edited = profile
        self._show_description(profile)
        self.query_one("#profile-chain", Static).update(
            f"chain: {profile.describe_chain()}" if profile else "\n".join(general) or "fix the fields marked above")
        warnings = profile.warnings() if profile else []
        self.query_one("#profile-warnings", Static).update("\n".join(f"⚠ {w}" for w in warnings))
        self.query_one("#profile-use", Button).disabled = profile is None
        return profile

    def _show_description(self, profile: SamplingProfile | None) -> None:
        """The profile the form holds: the one loaded, or once a field differs from it, the edited one (a preset's
        description would describe values no longer there)."""
        if profile is None:  # a field does not parse: the values are neither the loaded profile's nor a new one
            edited = any(self.form_values()[name] != field_text(self.base, name) for name, _ in FIELDS)
            name, description = ((self._edited_name(), self._edited_description()) if edited
                                 else (self.base.name, self.base.description))
        else:
            name, description = profile.name, profile.description
        name = name or "custom"
        self.query_one("#profile-description", Static).update(f"{name}: {description}" if description else name)

    def _edited_description(self) -> str:
        # A preset's description describes the preset's values, not these: say where they came from instead.
        if self.base.name in SamplingProfile.presets():
            return f"based on the {self.base.name} preset"
        return self.base.description

    def _edited_name(self) -> str:
        base = self.base.name or "custom"
        return base if base.endswith(" edited") else f"{base[:57]} edited"

    @on(Input.Changed)
    def _changed(self, event: Input.Changed) -> None:
        if event.input.id and event.input.id.startswith("field-"):
            self.validate_form()

    @on(OptionList.OptionHighlighted, "#profile-list")
    def _highlighted(self, event: OptionList.OptionHighlighted) -> None:
        entry = next((e for e in self.entries if e.key == event.option.id), None)
        if entry and entry.profile:
            self.load_form(entry.profile)

    @on(OptionList.OptionSelected, "#profile-list")
    @on(Input.Submitted)
    @on(Button.Pressed, "#profile-use")
    def action_use(self) -> None:
        if self.edited is not None:
            self.dismiss(self.edited)

    @on(Button.Pressed, "#profile-cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)

    @on(Button.Pressed, "#profile-save")
    def action_save_as(self) -> None:
        if self.edited is None:
            self.notify("Fix the fields marked in red first", severity="warning")
            return
        profile = self.edited
        # Never a preset's name: a saved "precise" would be listed beside the preset and never used.
        suggested = self.store.free_name((profile.name or "mine").removesuffix(" edited").replace(" ", "-"))

        saved: list[tuple[SamplingProfile, Path]] = []

        def save(name: str) -> str | None:
            """Save under `name`; what is wrong with it, or None. The dialog stays open on an error, the name kept
            to correct."""
            try:
                description = (f"based on the {profile.name} preset" if profile.name in SamplingProfile.presets()
                               else profile.description)
                named = SamplingProfile.model_validate({**profile.model_dump(), "name": name,
                                                        "description": description})
                saved.append((named, self.store.save(named)))
            except (ValidationError, ProfileError) as e:
                return error_text(e.errors()[0]) if isinstance(e, ValidationError) else str(e)
            except OSError as e:  # a read-only or missing config folder: say so, stay open
                return f"Cannot save the profile in {self.store.folder}: {e.strerror or e}"
            return None

        def done(name: str | None) -> None:
            if name is None or not saved:
                return
            named, path = saved[-1]
            self.notify(f"Saved profile {name} to {path}")
            self.refresh_entries(select=f"user:{name}")
            self.load_form(named)

        self.app.push_screen(TextPrompt("Save the profile as", suggested, accept="Save", check=save), done)

    def action_delete_profile(self) -> None:
        options = self.query_one("#profile-list", OptionList)
        if options.highlighted is None:
            return
        key = options.get_option_at_index(options.highlighted).id or ""
        if not key.startswith("user:"):
            self.notify("Presets cannot be deleted", severity="warning")
            return
        try:
            self.store.delete(key.removeprefix("user:"))
        except (ProfileError, OSError) as e:
            self.notify(str(e) if isinstance(e, ProfileError) else f"Cannot delete the profile: {e.strerror or e}",
                        severity="error")
            return
        self.notify(f"Deleted profile {key.removeprefix('user:')}")
        self.refresh_entries()
