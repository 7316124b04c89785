"""Launch configs of the kernels, one module per kernel module (kernels/<op>.py): the frozen config
type its launcher takes and the defaults per shape and GPU generation."""
