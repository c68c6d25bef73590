//! The C memory functions `core` and `alloc` call, and the personality symbol
//! the precompiled `alloc` refers to. There is no libc to supply them.
//!
//! The copies use `rep movsb`/`rep stosb` (fast on every CPU with ERMSB) in
//! inline asm, so the compiler cannot turn them back into calls to
//! themselves. The direction flag is clear on entry and after every call
//! (System V ABI), which the forward string ops rely on.

use core::arch::asm;

/// # Safety
/// C `memcpy` contract: non-overlapping, valid ranges.
#[no_mangle]
pub unsafe extern "C" fn memcpy(dst: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    // SAFETY: memcpy's contract (valid, non-overlapping ranges) is more than
    // copy_forward needs.
    unsafe { copy_forward(dst, src, n) };
    dst
}

/// # Safety
/// Both ranges valid for `n` bytes; if they overlap, `dst` is below `src`.
#[inline(always)]
unsafe fn copy_forward(dst: *mut u8, src: *const u8, n: usize) {
    // SAFETY: the caller guarantees both ranges are valid for `n` bytes.
    unsafe {
        asm!("rep movsb",
            inout("rcx") n => _, inout("rdi") dst => _, inout("rsi") src => _,
            options(nostack, preserves_flags));
    }
}

/// # Safety
/// C `memmove` contract: valid ranges, which may overlap.
#[no_mangle]
pub unsafe extern "C" fn memmove(dst: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    if (dst as usize).wrapping_sub(src as usize) >= n {
        // dst is below src or past its end: a forward copy never overwrites
        // bytes it has yet to read.
        // SAFETY: the caller guarantees both ranges are valid, and this is
        // the overlap copy_forward allows.
        unsafe { copy_forward(dst, src, n) };
        return dst;
    }
    // dst overlaps the tail of src: copy backwards, from the last byte.
    // SAFETY: the caller guarantees both ranges are valid; n > 0 here since
    // the wrapping difference is below n. The direction flag is restored.
    unsafe {
        asm!("std", "rep movsb", "cld",
            inout("rcx") n => _, inout("rdi") dst.add(n - 1) => _, inout("rsi") src.add(n - 1) => _,
            options(nostack));
    }
    dst
}

/// # Safety
/// C `memset` contract: `dst` valid for `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn memset(dst: *mut u8, c: i32, n: usize) -> *mut u8 {
    // SAFETY: the caller guarantees the range is valid for writes.
    unsafe {
        asm!("rep stosb",
            inout("rcx") n => _, inout("rdi") dst => _, in("al") c as u8,
            options(nostack, preserves_flags));
    }
    dst
}

/// # Safety
/// C `memcmp` contract: both ranges valid for `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn memcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    let mut i = 0;
    while i < n {
        // SAFETY: i < n and the caller guarantees n readable bytes.
        let (x, y) = unsafe { (*a.add(i), *b.add(i)) };
        if x != y {
            return x as i32 - y as i32;
        }
        i += 1;
    }
    0
}

/// # Safety
/// As [`memcmp`]; only zero/non-zero of the result is meaningful.
#[no_mangle]
pub unsafe extern "C" fn bcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    // SAFETY: bcmp's contract is memcmp's.
    unsafe { memcmp(a, b, n) }
}

/// Never called: panics abort. The precompiled `alloc` (built for unwinding)
/// still names it, so it must resolve.
#[no_mangle]
pub extern "C" fn rust_eh_personality() {}

/// Landing pads in the precompiled `alloc` (built to unwind) end in this
/// call; with `panic = "abort"` no unwind ever starts, so it is never
/// reached, but some of those functions (`String::from_utf8_lossy`, ...)
/// still name it.
#[no_mangle]
pub extern "C" fn _Unwind_Resume() -> ! {
    crate::panic::park()
}
