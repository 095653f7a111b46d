"""One exception tree for everything ptxc reports to a user.

Every error carries enough context to be printed as a single clear message; the CLI maps
`UserError` subclasses to exit code 2 and `CheckFailed` subclasses to exit code 1.
"""

from __future__ import annotations


class PtxcError(Exception):
    """Base class of every error ptxc raises on purpose."""

    exit_code = 1


class UserError(PtxcError):
    """Bad input from the user: a spec, a command-line argument, an input file."""

    exit_code = 2


class SpecError(UserError):
    """A kernel spec is malformed or asks for something unsupported.

    Formats as: ``FILE: kernel 'NAME' (or #INDEX): KEY: MESSAGE``.
    """

    def __init__(self, message: str, *, file: str | None = None, kernel: str | None = None,
                 key: str | None = None):
        self.file, self.kernel, self.key, self.detail = file, kernel, key, message
        parts = [p for p in (file, f"kernel {kernel}" if kernel else None,
                             f"key '{key}'" if key else None) if p]
        super().__init__(": ".join(parts + [message]))

    def with_context(self, *, file: str | None = None, kernel: str | None = None) -> "SpecError":
        return SpecError(self.detail, file=self.file or file, kernel=self.kernel or kernel,
                         key=self.key)


class InputError(UserError):
    """Runtime inputs (npz tensors, --set values, shapes) do not match an artifact."""


class ToolchainError(UserError):
    """ptxas (or another external tool) is missing, broken or too old."""


class IRError(PtxcError):
    """A kernel generator built ill-typed IR: a bug in ptxc, reported with the instruction."""


class CheckFailed(PtxcError):
    """A verification or numerical check failed (exit code 1)."""

    exit_code = 1


class AssemblyError(CheckFailed):
    """ptxas rejected generated PTX; carries ptxas's message and the PTX line it names."""


class VerifyError(CheckFailed):
    """An artifact set does not match its hashes, schema or PTX signature."""


class EmulationError(CheckFailed):
    """The PTX emulator hit undefined behaviour or an unsupported instruction.

    Names the kernel, the PTX line and its text, the block and thread, and the address where relevant.
    """
