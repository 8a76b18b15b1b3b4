"""Developer tools that the runtime `import jaxquant` never imports: ahead-of-time
compile checks of the Pallas kernels (`compile_check`)."""
