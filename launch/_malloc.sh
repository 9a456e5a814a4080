# Sourced by the launch scripts that train or generate (demo.sh, real_model.sh): run them under tcmalloc (or
# jemalloc) when one is installed. XLA:CPU allocates a training step's temporaries afresh on every call (6 GB a
# step for the 135M shape at batch 8 x 512), and glibc's malloc hands those pages back to the kernel, which
# zero-fills them again on the next step; tcmalloc and jemalloc keep freed memory for reuse. Measured on the 135M
# training step: 8% faster with tcmalloc, 5% with jemalloc (docs/performance.md). Debian packages:
# libtcmalloc-minimal4, libjemalloc2.
#
# CAUSAL_LM_MALLOC: auto (default: the first of tcmalloc, jemalloc that is installed), system (glibc's malloc), or
# the path of an allocator's shared library. An LD_PRELOAD already set is left alone.
_causal_lm_malloc() {
  local choice="${CAUSAL_LM_MALLOC:-auto}" lib="" candidate
  [ -n "${LD_PRELOAD:-}" ] && return 0
  case "$choice" in
    system) return 0 ;;
    auto)
      for candidate in /usr/lib/{x86_64,aarch64}-linux-gnu/libtcmalloc_minimal.so.4 \
                       /usr/lib/{x86_64,aarch64}-linux-gnu/libjemalloc.so.2; do
        if [ -r "$candidate" ]; then lib="$candidate"; break; fi
      done
      [ -z "$lib" ] && return 0
      ;;
    *)
      if [ ! -r "$choice" ]; then
        echo "error: CAUSAL_LM_MALLOC=$choice: no such library (use auto, system or the path of a .so)" >&2
        return 1
      fi
      lib="$choice"
      ;;
  esac
  export LD_PRELOAD="$lib"
  # tcmalloc reports every allocation over 1 GiB on stderr by default: a training step's buffers are that large.
  export TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD="${TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD:-1099511627776}"
  echo "[malloc] $(basename "$lib") (CAUSAL_LM_MALLOC=system for glibc's malloc)" >&2
}
_causal_lm_malloc || exit 2
