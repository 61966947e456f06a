// Linked into the executables of a -DLOCKS_SANITIZE=ON build only. ASan's default is to abort when an
// allocation fails; ours are checked (a KV pool whose address space the system refuses gets an error
// naming its size), so let calloc return null as it does without the sanitizer.
extern "C" const char* __asan_default_options() { return "allocator_may_return_null=1"; }
