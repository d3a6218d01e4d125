"""The build pipeline's shared front: what a build was asked for (`BuildOptions`), the progress callbacks
(`BuildEvents`) and the model spec resolved once (`BuildSession`). Both build modes start here: the JIT
build (`omni_compile.builder`) and the ahead-of-time artifact build (`omni_compile.artifact.build`), and
`omni-compile inspect` of a model; `record` keeps what `inspect` later reads of each compile."""

from omni_compile.build.session import BuildEvents, BuildOptions, BuildSession, check_out, sync

__all__ = ["BuildEvents", "BuildOptions", "BuildSession", "check_out", "sync"]
