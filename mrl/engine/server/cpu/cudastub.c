/* CPU mode for SGLang: a stand-in for the NVIDIA driver library (libcuda.so.1) on hosts without a GPU.
 *
 * sglang-kernel 0.4.1 ships CUDA builds only, and sglang 0.5.10 imports sgl_kernel.kvcacheio
 * unconditionally (srt/mem_cache/memory_pool_host.py); its common_ops.abi3.so links 8 driver symbols.
 * Every entry point here reports CUresult 100 ("no device"), so torch and SGLang fall back to CPU.
 * mrl compiles this at setup/launch time (mrl/engine/cpu_mode.py); the binary is never committed. */
typedef int CUresult;
static const char *msg = "no CUDA driver (mrl CPU-mode stub)";
CUresult cuGetErrorString(CUresult e, const char **s) { (void)e; if (s) *s = msg; return 0; }
CUresult cuMemAddressFree(void *a, unsigned long n) { (void)a; (void)n; return 100; }
CUresult cuMemGetAddressRange_v2(void *b, void *s, unsigned long long p) { (void)b; (void)s; (void)p; return 100; }
CUresult cuMemRelease(unsigned long long h) { (void)h; return 100; }
CUresult cuMemRetainAllocationHandle(void *h, void *a) { (void)h; (void)a; return 100; }
CUresult cuMemSetAccess(unsigned long long p, unsigned long n, const void *d, unsigned long c) { (void)p; (void)n; (void)d; (void)c; return 100; }
CUresult cuMemUnmap(unsigned long long p, unsigned long n) { (void)p; (void)n; return 100; }
CUresult cuPointerGetAttribute(void *d, int a, unsigned long long p) { (void)d; (void)a; (void)p; return 100; }
CUresult cuInit(unsigned int f) { (void)f; return 100; }
CUresult cuDriverGetVersion(int *v) { if (v) *v = 0; return 100; }
CUresult cuDeviceGetCount(int *c) { if (c) *c = 0; return 100; }
CUresult cuGetProcAddress_v2(const char *s, void **p, int v, unsigned long long f, void *st) { (void)s; (void)v; (void)f; (void)st; if (p) *p = 0; return 100; }
CUresult cuGetProcAddress(const char *s, void **p, int v, unsigned long long f) { (void)s; (void)v; (void)f; if (p) *p = 0; return 100; }
