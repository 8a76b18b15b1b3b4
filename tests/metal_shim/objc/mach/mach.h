// The one declaration of <mach/mach.h> metal_src/metal_ffi.mm uses (see Foundation/Foundation.h here).
#pragma once
extern unsigned long vm_page_size;
