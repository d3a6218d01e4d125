"""The build pipeline (`pipeline.BuildPipeline`): what a build was asked for (`BuildOptions`), the progress
callbacks (`BuildEvents`), the model spec resolved once (`BuildSession`), the stages from resolve to publish,
the region compilers that make the build modes differ (`compilers`: Inductor JIT, AOTInductor package,
Inductor standalone) and the one report schema (`report`). `omni-compile inspect` of a model resolves
through `BuildSession` too; `record` keeps what `inspect` later reads of each compile."""

from omni_compile.build.session import BuildEvents, BuildOptions, BuildSession, check_out, sync

__all__ = ["BuildEvents", "BuildOptions", "BuildSession", "check_out", "sync"]
