/* A stand-in libcuda for tests without a GPU: the driver calls ptxc's loaders use, with
 * "device" memory from the host heap. It executes nothing: it records every module load (the
 * image bytes), function lookup, attribute call and launch (geometry, parameter bytes and a
 * snapshot of all device memory) under $PTXC_STUB_LOG, for the test to replay in ptxc.emu.
 * The device is configured by $PTXC_STUB_SM (compute capability, e.g. 90), $PTXC_STUB_SMS (SM
 * count) and $PTXC_STUB_SMEM_OPTIN (max dynamic shared memory per block). */
#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_ITEMS 4096

typedef struct { unsigned char *data; size_t size; } allocation_t;
typedef struct { int module; char name[256]; int max_dynamic_smem; } function_t;
typedef struct { const unsigned char *image; size_t size; } module_t;

static allocation_t allocations[MAX_ITEMS];
static function_t functions[MAX_ITEMS];
static module_t modules[MAX_ITEMS];
static int num_allocations, num_functions, num_modules, num_launches;

static int env_int(const char *name, int fallback) {
    const char *v = getenv(name);
    return v && *v ? atoi(v) : fallback;
}

static FILE *log_file(const char *name, const char *mode) {
    char path[4096];
    const char *dir = getenv("PTXC_STUB_LOG");
    snprintf(path, sizeof path, "%s/%s", dir && *dir ? dir : ".", name);
    return fopen(path, mode);
}

static void event(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
#include <stdarg.h>
static void event(const char *fmt, ...) {
    FILE *f = log_file("events.txt", "a");
    if (!f) return;
    va_list ap;
    va_start(ap, fmt);
    vfprintf(f, fmt, ap);
    va_end(ap);
    fputc('\n', f);
    fclose(f);
}

CUresult cuInit(unsigned flags) { (void)flags; event("init"); return CUDA_SUCCESS; }
CUresult cuDeviceGet(CUdevice *d, int ordinal) { *d = ordinal; return ordinal == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE; }
CUresult cuDeviceGetCount(int *n) { *n = 1; return CUDA_SUCCESS; }
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) { (void)d; *c = (CUcontext)(uintptr_t)0x1000; return CUDA_SUCCESS; }
CUresult cuDevicePrimaryCtxRelease(CUdevice d) { (void)d; return CUDA_SUCCESS; }
CUresult cuCtxSetCurrent(CUcontext c) { (void)c; return CUDA_SUCCESS; }
CUresult cuCtxSynchronize(void) { return CUDA_SUCCESS; }
CUresult cuStreamSynchronize(CUstream s) { (void)s; return CUDA_SUCCESS; }

CUresult cuDeviceGetAttribute(int *value, CUdevice_attribute attr, CUdevice d) {
    (void)d;
    int sm = env_int("PTXC_STUB_SM", 90);
    switch (attr) {
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *value = sm / 10; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *value = sm % 10; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *value = env_int("PTXC_STUB_SMS", 132); break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: *value = env_int("PTXC_STUB_SMEM_OPTIN", 232448); break;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
    event("device_attribute %d %d", (int)attr, *value);
    return CUDA_SUCCESS;
}

CUresult cuMemAlloc(CUdeviceptr *p, size_t size) {
    if (size == 0 || num_allocations == MAX_ITEMS) return CUDA_ERROR_INVALID_VALUE;
    size_t rounded = (size + 255) & ~(size_t)255;
    unsigned char *data = (unsigned char *)aligned_alloc(256, rounded);
    if (!data) return CUDA_ERROR_OUT_OF_MEMORY;
    memset(data, 0xA5, rounded);  /* never-written device memory is garbage, not zeros */
    allocations[num_allocations++] = (allocation_t){data, size};
    *p = (CUdeviceptr)(uintptr_t)data;
    event("alloc %#llx %zu", (unsigned long long)*p, size);
    return CUDA_SUCCESS;
}

static allocation_t *find_allocation(CUdeviceptr p, size_t n) {
    for (int i = 0; i < num_allocations; i++) {
        uintptr_t base = (uintptr_t)allocations[i].data;
        if (allocations[i].data && p >= base && p + n <= base + allocations[i].size) return &allocations[i];
    }
    return NULL;
}

CUresult cuMemFree(CUdeviceptr p) {
    allocation_t *a = find_allocation(p, 0);
    if (!a || (uintptr_t)a->data != p) return CUDA_ERROR_INVALID_VALUE;
    free(a->data);
    a->data = NULL;
    return CUDA_SUCCESS;
}

CUresult cuMemcpyHtoD(CUdeviceptr dst, const void *src, size_t n) {
    if (!find_allocation(dst, n)) return CUDA_ERROR_INVALID_VALUE;
    memcpy((void *)(uintptr_t)dst, src, n);
    return CUDA_SUCCESS;
}

CUresult cuMemcpyDtoH(void *dst, CUdeviceptr src, size_t n) {
    if (!find_allocation(src, n)) return CUDA_ERROR_INVALID_VALUE;
    memcpy(dst, (const void *)(uintptr_t)src, n);
    return CUDA_SUCCESS;
}

/* An image's length from its own header: ELF64 (cubin), fatbin, else NUL-terminated PTX. */
static size_t image_size(const unsigned char *image, const char **kind) {
    if (!memcmp(image, "\x7f" "ELF", 4)) {  /* ELF64: the furthest header table or section */
        uint64_t shoff, phoff, end;
        uint16_t phentsize, phnum, shentsize, shnum;
        memcpy(&phoff, image + 0x20, 8); memcpy(&shoff, image + 0x28, 8);
        memcpy(&phentsize, image + 0x36, 2); memcpy(&phnum, image + 0x38, 2);
        memcpy(&shentsize, image + 0x3A, 2); memcpy(&shnum, image + 0x3C, 2);
        end = shoff + (uint64_t)shentsize * shnum;
        if (phoff + (uint64_t)phentsize * phnum > end) end = phoff + (uint64_t)phentsize * phnum;
        for (unsigned i = 0; i < shnum; i++) {
            const unsigned char *sh = image + shoff + (uint64_t)i * shentsize;
            uint32_t type; uint64_t offset, size;
            memcpy(&type, sh + 4, 4); memcpy(&offset, sh + 0x18, 8); memcpy(&size, sh + 0x20, 8);
            if (type != 8 /* SHT_NOBITS */ && offset + size > end) end = offset + size;
        }
        *kind = "cubin";
        return (size_t)end;
    }
    uint32_t magic; memcpy(&magic, image, 4);
    if (magic == 0xBA55ED50u) {
        uint16_t header; uint64_t body;
        memcpy(&header, image + 6, 2); memcpy(&body, image + 8, 8);
        *kind = "fatbin";
        return header + (size_t)body;
    }
    *kind = "ptx";
    return strlen((const char *)image);
}

CUresult cuModuleLoadData(CUmodule *m, const void *image) {
    if (num_modules == MAX_ITEMS) return CUDA_ERROR_OUT_OF_MEMORY;
    const char *kind;
    size_t size = image_size((const unsigned char *)image, &kind);
    unsigned char *copy = (unsigned char *)malloc(size + 1);
    memcpy(copy, image, size);
    copy[size] = 0;
    modules[num_modules] = (module_t){copy, size};
    char name[64];
    snprintf(name, sizeof name, "module_%d.bin", num_modules);
    FILE *f = log_file(name, "wb");
    if (f) { fwrite(copy, 1, size, f); fclose(f); }
    event("module %d %s %zu", num_modules, kind, size);
    *m = (CUmodule)(uintptr_t)(num_modules + 1);
    num_modules++;
    return CUDA_SUCCESS;
}

CUresult cuModuleUnload(CUmodule m) { event("unload %d", (int)(uintptr_t)m - 1); return CUDA_SUCCESS; }

static int image_has(const module_t *m, const char *name) {
    size_t n = strlen(name);
    for (size_t i = 0; i + n <= m->size; i++)
        if (!memcmp(m->image + i, name, n) && (i + n == m->size || m->image[i + n] == 0 || m->image[i + n] == '(' ||
                                               m->image[i + n] == ' ' || m->image[i + n] == '\n'))
            return 1;
    return 0;
}

CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name) {
    int module = (int)(uintptr_t)m - 1;
    if (module < 0 || module >= num_modules) return CUDA_ERROR_INVALID_HANDLE;
    if (!image_has(&modules[module], name)) return CUDA_ERROR_NOT_FOUND;
    function_t *fn = &functions[num_functions];
    fn->module = module;
    snprintf(fn->name, sizeof fn->name, "%s", name);
    fn->max_dynamic_smem = 48 * 1024;
    event("function %d %d %s", num_functions, module, name);
    *f = (CUfunction)(uintptr_t)(++num_functions);
    return CUDA_SUCCESS;
}

CUresult cuFuncSetAttribute(CUfunction f, CUfunction_attribute attr, int value) {
    int i = (int)(uintptr_t)f - 1;
    if (i < 0 || i >= num_functions) return CUDA_ERROR_INVALID_HANDLE;
    event("func_attribute %d %d %d", i, (int)attr, value);
    if (attr != CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) return CUDA_SUCCESS;
    if (value > env_int("PTXC_STUB_SMEM_OPTIN", 232448)) return CUDA_ERROR_INVALID_VALUE;
    functions[i].max_dynamic_smem = value;
    return CUDA_SUCCESS;
}

CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned smem, CUstream stream, void **kernel_params, void **extra) {
    int i = (int)(uintptr_t)f - 1;
    if (i < 0 || i >= num_functions) return CUDA_ERROR_INVALID_HANDLE;
    if (smem > (unsigned)functions[i].max_dynamic_smem) return CUDA_ERROR_INVALID_VALUE;  /* opt-in missing */
    if (kernel_params || !extra) return CUDA_ERROR_INVALID_VALUE;  /* ptxc passes one parameter buffer */
    void *buffer = NULL;
    size_t size = 0;
    for (int k = 0; extra[k] != CU_LAUNCH_PARAM_END; k += 2) {
        if (extra[k] == CU_LAUNCH_PARAM_BUFFER_POINTER) buffer = extra[k + 1];
        else if (extra[k] == CU_LAUNCH_PARAM_BUFFER_SIZE) size = *(size_t *)extra[k + 1];
        else return CUDA_ERROR_INVALID_VALUE;
    }
    if (!buffer) return CUDA_ERROR_INVALID_VALUE;
    char name[64];
    snprintf(name, sizeof name, "launch_%d.params", num_launches);
    FILE *p = log_file(name, "wb");
    if (p) { fwrite(buffer, 1, size, p); fclose(p); }
    snprintf(name, sizeof name, "launch_%d.mem", num_launches);
    FILE *m = log_file(name, "wb");
    for (int a = 0; m && a < num_allocations; a++) {
        if (!allocations[a].data) continue;
        uint64_t header[2] = {(uint64_t)(uintptr_t)allocations[a].data, allocations[a].size};
        fwrite(header, 8, 2, m);
        fwrite(allocations[a].data, 1, allocations[a].size, m);
    }
    if (m) fclose(m);
    event("launch %d %d %s %u %u %u %u %u %u %u %zu %p", num_launches, i, functions[i].name, gx, gy, gz, bx, by, bz,
          smem, size, (void *)stream);
    num_launches++;
    return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult e, const char **s) {
    static char text[32];
    snprintf(text, sizeof text, "CUresult_%d", (int)e);
    *s = text;
    return CUDA_SUCCESS;
}

CUresult cuGetErrorString(CUresult e, const char **s) { return cuGetErrorName(e, s); }

/* A tensor map in the emulator's own 128-byte layout (ptxc/emu/tensormap.py): magic "PTXCTMAP",
 * u32 rank, u32 element bytes, u64 global address, u32 swizzle bytes, u32 dims[5], u32 box[5],
 * u64 byte strides of dims 1..4 -- so a replay can hand the recorded parameter bytes to the
 * emulator (after rebasing the address). Checks the driver's documented rules for tiled maps. */
CUresult cuTensorMapEncodeTiled(CUtensorMap *map, CUtensorMapDataType dtype, cuuint32_t rank, void *address,
                                const cuuint64_t *dims, const cuuint64_t *strides, const cuuint32_t *box,
                                const cuuint32_t *element_strides, CUtensorMapInterleave interleave,
                                CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2, CUtensorMapFloatOOBfill oob) {
    static const int elem_bytes[] = {1, 2, 4, 4, 8, 8, 2, 4, 8, 2};
    static const unsigned swizzle_bytes[] = {0, 32, 64, 128};
    (void)l2;
    if (!map || rank < 1 || rank > 5 || (unsigned)dtype > CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 ||
        (uintptr_t)address % 16 || interleave != CU_TENSOR_MAP_INTERLEAVE_NONE ||
        (unsigned)swizzle > CU_TENSOR_MAP_SWIZZLE_128B || oob != CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
        return CUDA_ERROR_INVALID_VALUE;
    int esize = elem_bytes[dtype];
    for (unsigned i = 0; i < rank; i++) {
        if (dims[i] == 0 || dims[i] > (1ull << 32) || box[i] == 0 || box[i] > 256 || element_strides[i] != 1)
            return CUDA_ERROR_INVALID_VALUE;
        if (i > 0 && (strides[i - 1] % 16 || strides[i - 1] >= (1ull << 40))) return CUDA_ERROR_INVALID_VALUE;
    }
    if ((box[0] * esize) % 16 || (swizzle && box[0] * esize > swizzle_bytes[swizzle])) return CUDA_ERROR_INVALID_VALUE;
    unsigned char *raw = (unsigned char *)map;
    memset(raw, 0, 128);
    memcpy(raw, "PTXCTMAP", 8);
    uint32_t u32[2] = {rank, (uint32_t)esize};
    memcpy(raw + 8, u32, 8);
    uint64_t gaddr = (uint64_t)(uintptr_t)address;
    memcpy(raw + 16, &gaddr, 8);
    uint32_t sw = swizzle_bytes[swizzle];
    memcpy(raw + 24, &sw, 4);
    for (unsigned i = 0; i < 5; i++) {
        uint32_t d = i < rank ? (uint32_t)dims[i] : 1, b = i < rank ? box[i] : 1;
        memcpy(raw + 32 + 4 * i, &d, 4);
        memcpy(raw + 52 + 4 * i, &b, 4);
        if (i < 4) {
            uint64_t s = i + 1 < rank ? strides[i] : 0;
            memcpy(raw + 72 + 8 * i, &s, 8);
        }
    }
    event("tensor_map %u %#llx", rank, (unsigned long long)gaddr);
    return CUDA_SUCCESS;
}
