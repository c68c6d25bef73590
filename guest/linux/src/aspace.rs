//! Address spaces of forked processes: the same virtual addresses as the
//! parent's, other memory behind them.
//!
//! The guest runs at CPL3 with the VMM's identity page tables, and cannot
//! load CR3 itself (ring 0 is emulated, ~5000x slower). So a process made by
//! `fork` gets a page-table tree built here, in runtime memory, from the
//! VMM's tables (readable at CPL3 from `layout::PAGE_TABLE_ROOT`), and the
//! scheduler loads it with the ADDRESS_SPACE hypercall when it switches to a
//! thread of another process (`sched`). The tree is the VMM's identity map
//! except for the program's memory: the pages of its image (4 KiB page
//! tables: the image shares its first and last 2 MiB with the runtime and
//! the vCPU stack) and the 2 MiB chunks of its memory region (`mm`), which
//! map this process's own frames. Everything of the runtime (code, heap,
//! kernel stacks, these tables, the frames themselves) stays identity-mapped
//! and shared, so the system-call layer runs unchanged in every process and
//! reaches the calling process's memory at the addresses the program passes,
//! and hypercall blocks and DMA buffers (runtime memory) keep meaning
//! guest-physical addresses.
//!
//! Copy, not copy-on-write: a write-protection fault reaches a ring-0 stub
//! that stops the VM (there is no cheap way to handle it in the guest), so
//! `fork` copies what the parent uses: its image pages and every 2 MiB chunk
//! of its region holding a claimed page (only the claimed bytes; the rest of
//! a fresh frame is zero, as unclaimed memory always is). Chunks the child
//! claims later get a zeroed frame when claimed (`back`). A chunk's frame
//! is a free 2 MiB chunk of the program region that process 1's allocator
//! lends (`mm`): the children's copies share the VM's memory with the
//! program, not the runtime's fixed share (`rtmem=`), which only backs
//! image pages and chunks when the region has none free. Process 1 runs
//! on the VMM's tables, where a lent chunk is at its own address; every
//! other space maps the whole region a second time at [`WINDOW`], where
//! the runtime reaches a frame whatever process is loaded ([`reach`]).
//! Everything lives in guest RAM and the vCPU's CR3, so checkpoints and
//! failover carry processes like any other state.
//!
//! Measured (guest/README.md, `fork bench`): an address-space switch costs
//! 43-50 µs (the hypercall, KVM_SET_SREGS, KVM's shadow tables for the new
//! root); a fork 2-4.5 ms per MiB copied into memory touched for the first
//! time, 0.22-0.36 ms per MiB into reused memory (measured with frames on
//! the runtime's heap; lent chunks are the same kind of memory).

use alloc::alloc::{alloc_zeroed, dealloc};
use alloc::boxed::Box;
use alloc::collections::BTreeMap;
use core::alloc::Layout;
use core::sync::atomic::{AtomicU64, Ordering};

use ftvm_abi::layout::PAGE_TABLE_ROOT;

use crate::errno::{Errno, ENOMEM};
use crate::mm::PAGE;

/// The granule of a process's memory region: one page-directory entry.
pub const CHUNK: u64 = 2 << 20;
const GIB: u64 = 1 << 30;

const PTE_PRESENT: u64 = 1;
const PTE_WRITE: u64 = 1 << 1;
const PTE_USER: u64 = 1 << 2;
const PTE_LARGE: u64 = 1 << 7;
const PTE_ADDR: u64 = 0x000f_ffff_ffff_f000;
/// What user memory is mapped with (the VMM's flags for RAM).
const USER: u64 = PTE_PRESENT | PTE_WRITE | PTE_USER;

#[repr(C, align(4096))]
struct Table([u64; 512]);

impl Table {
    /// A copy of the table at guest-physical `addr` (the VMM's, readable).
    fn copy_of(addr: u64) -> Box<Table> {
        // SAFETY: `addr` comes from the VMM's tables, which lie in the
        // identity-mapped, CPL3-readable system area (guest ABI).
        Box::new(unsafe { (addr as *const Table).read() })
    }

    fn addr(&self) -> u64 {
        self as *const Table as u64
    }
}

/// Runtime memory a fork or a child's new mapping leaves free at least: the
/// runtime's own allocations (socket buffers, files, page tables) must not
/// fail for want of it, which would end the VM.
const RESERVE: usize = 8 << 20;

/// Where every address space but process 1's (the VMM's tables) sees the
/// program region's physical memory: at this offset from its
/// guest-physical address (PML4 entry 1; RAM is far below 512 GiB). In a
/// child the region's own addresses map the child's frames, so a chunk of
/// the region lent to a process as a frame is reached here whatever tables
/// are loaded ([`reach`]).
const WINDOW: u64 = 512 * GIB;

/// The window's tables, shared by every address space: 2 MiB pages over
/// the program region, built once (`init`).
struct Window {
    pdpt: Box<Table>,
    _pds: alloc::vec::Vec<Box<Table>>,
}

static WINDOW_TABLES: spin::Once<Window> = spin::Once::new();

/// The tables loaded now (0: the VMM's), kept by [`load`].
static LOADED: AtomicU64 = AtomicU64::new(0);

/// Map the program region `[base, end)` (2 MiB aligned) in the window.
pub fn init(base: u64, end: u64) {
    WINDOW_TABLES.call_once(|| {
        let mut pdpt = Box::new(Table([0; 512]));
        let mut pds = alloc::vec::Vec::new();
        for gib in base / GIB..end.div_ceil(GIB) {
            let mut pd = Box::new(Table([0; 512]));
            for (i, e) in pd.0.iter_mut().enumerate() {
                let phys = gib * GIB + i as u64 * CHUNK;
                if (base..end).contains(&phys) {
                    *e = phys | USER | PTE_LARGE;
                }
            }
            pdpt.0[gib as usize] = pd.addr() | USER;
            pds.push(pd);
        }
        Window { pdpt, _pds: pds }
    });
}

/// Where the runtime reaches guest-physical program-region memory `phys`
/// with the tables loaded now: at `phys` under the VMM's identity tables,
/// through the window under a process's own.
fn reach(phys: u64) -> *mut u8 {
    if LOADED.load(Ordering::Relaxed) == 0 {
        phys as *mut u8
    } else {
        (WINDOW + phys) as *mut u8
    }
}

/// Memory a process has in place of the identity-mapped one at some
/// address, zero when made: a 2 MiB chunk of the program region that
/// process 1's allocator lends (free memory of the region, not the
/// runtime's share), or, for pages and when the region has no free chunk,
/// a block of the runtime's heap. Files in memory keep large data in
/// chunk frames too (`filedata`).
pub struct Frame {
    addr: u64,
    size: u64,
    from: Source,
}

enum Source {
    Region,
    Heap(Layout),
}

impl Frame {
    fn new(size: u64) -> Result<Frame, Errno> {
        if size == CHUNK {
            if let Some(addr) = lender(|m| m.lend(CHUNK)).flatten() {
                return Ok(Frame { addr, size, from: Source::Region });
            }
        }
        if ftvm_rt::heap::free_bytes() < size as usize + RESERVE {
            return Err(ENOMEM);
        }
        let layout = Layout::from_size_align(size as usize, size as usize).map_err(|_| ENOMEM)?;
        // SAFETY: a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(ENOMEM);
        }
        Ok(Frame { addr: ptr as u64, size, from: Source::Heap(layout) })
    }

    /// Its guest-physical address, what page tables map.
    fn addr(&self) -> u64 {
        self.addr
    }

    /// A zero 2 MiB frame.
    pub fn chunk() -> Result<Frame, Errno> {
        Frame::new(CHUNK)
    }

    /// Where the runtime reaches it now (valid until the tables loaded
    /// change: no system call switches them in the middle of a copy).
    pub fn ptr(&self) -> *mut u8 {
        match self.from {
            Source::Region => reach(self.addr),
            // The runtime's heap is identity-mapped in every space.
            Source::Heap(_) => self.addr as *mut u8,
        }
    }
}

/// `f` on process 1's memory allocator, which lends the region's free
/// chunks; None once process 1 has ended (the VM ends with it).
fn lender<R>(f: impl FnOnce(&mut crate::mm::Memory) -> R) -> Option<R> {
    let init = crate::process::get(crate::process::INIT)?;
    let mut mem = init.mem.lock();
    mem.as_mut().map(f)
}

impl Drop for Frame {
    fn drop(&mut self) {
        match self.from {
            Source::Region => {
                // Free region memory is zero: zero it before giving it back.
                // SAFETY: the chunk was lent to this frame alone, and
                // `reach` says where it is under the tables loaded now.
                unsafe { core::ptr::write_bytes(self.ptr(), 0, self.size as usize) };
                lender(|m| m.give_back(self.addr));
            }
            // SAFETY: allocated in `new` with this layout.
            Source::Heap(layout) => unsafe { dealloc(self.addr as *mut u8, layout) },
        }
    }
}

// SAFETY: a Frame owns its memory; the runtime runs on one vCPU.
unsafe impl Send for Frame {}

pub struct AddressSpace {
    pml4: Box<Table>,
    pdpt: Box<Table>,
    /// Page directories of their own, by GiB.
    pds: BTreeMap<u64, Box<Table>>,
    /// Page tables of their own, by the 2 MiB chunk they map.
    pts: BTreeMap<u64, Box<Table>>,
    /// Frames by the virtual address they are mapped at (pages and chunks).
    frames: BTreeMap<u64, Frame>,
}

impl AddressSpace {
    /// The VMM's identity map, in tables of our own.
    fn new() -> AddressSpace {
        let mut pml4 = Table::copy_of(PAGE_TABLE_ROOT);
        let pdpt = Table::copy_of(pml4.0[0] & PTE_ADDR);
        pml4.0[0] = pdpt.addr() | USER;
        pml4.0[1] = WINDOW_TABLES.get().expect("aspace::init ran at start").pdpt.addr() | USER;
        AddressSpace { pml4, pdpt, pds: BTreeMap::new(), pts: BTreeMap::new(), frames: BTreeMap::new() }
    }

    /// The CR3 value that loads it.
    pub fn root(&self) -> u64 {
        self.pml4.addr()
    }

    fn pd(&mut self, va: u64) -> &mut Table {
        let gib = va / GIB;
        let pdpt = &mut self.pdpt;
        self.pds.entry(gib).or_insert_with(|| {
            let pd = Table::copy_of(pdpt.0[gib as usize] & PTE_ADDR);
            pdpt.0[gib as usize] = pd.addr() | USER;
            pd
        })
    }

    fn pd_index(va: u64) -> usize {
        ((va % GIB) / CHUNK) as usize
    }

    /// Map the 2 MiB chunk at `va` to `frame` (0: nothing).
    fn set_chunk(&mut self, va: u64, frame: u64) {
        let entry = if frame == 0 { 0 } else { frame | USER | PTE_LARGE };
        self.pd(va).0[Self::pd_index(va)] = entry;
    }

    /// Map the page at `va` to `frame`, splitting its chunk into 4 KiB pages
    /// (identity for the others) the first time.
    fn set_page(&mut self, va: u64, frame: u64) {
        let chunk = va & !(CHUNK - 1);
        if !self.pts.contains_key(&chunk) {
            let mut pt = Box::new(Table([0; 512]));
            for (i, e) in pt.0.iter_mut().enumerate() {
                *e = (chunk + i as u64 * PAGE) | USER;
            }
            let addr = pt.addr();
            self.pd(chunk).0[Self::pd_index(chunk)] = addr | USER;
            self.pts.insert(chunk, pt);
        }
        let pt = self.pts.get_mut(&chunk).expect("just made");
        pt.0[((va % CHUNK) / PAGE) as usize] = frame | USER;
    }

    /// A copy of the calling process's memory (seen through the tables now
    /// loaded): `image` pages copied one by one, and in `region` (2 MiB
    /// aligned) the `used` ranges copied into fresh chunks; the region's
    /// other chunks are left unmapped until [`back`](Self::back).
    pub fn fork(image: (u64, u64), region: (u64, u64), used: &[(u64, u64)]) -> Result<AddressSpace, Errno> {
        let mut a = AddressSpace::new();
        let mut page = image.0 & !(PAGE - 1);
        while page < image.1 {
            let f = Frame::new(PAGE)?;
            // SAFETY: `page` is a page of the program's image, mapped in the
            // calling process; the frame is a fresh page no one else uses.
            unsafe { core::ptr::copy_nonoverlapping(page as *const u8, f.ptr(), PAGE as usize) };
            a.set_page(page, f.addr());
            a.frames.insert(page, f);
            page += PAGE;
        }
        let mut chunk = region.0;
        while chunk < region.1 {
            a.set_chunk(chunk, 0);
            chunk += CHUNK;
        }
        for &(start, end) in used {
            a.back(start, end)?;
            let mut at = start;
            while at < end {
                let chunk = at & !(CHUNK - 1);
                let upto = end.min(chunk + CHUNK);
                // SAFETY: [at, upto) is claimed memory of the calling
                // process, mapped in its tables; the destination is inside
                // the chunk's fresh frame, which no one else uses.
                unsafe {
                    let dst = a.frames[&chunk].ptr().add((at - chunk) as usize);
                    core::ptr::copy_nonoverlapping(at as *const u8, dst, (upto - at) as usize);
                }
                at = upto;
            }
        }
        Ok(a)
    }

    /// Give every chunk of region memory `[start, end)` a (zeroed) frame if
    /// it has none; all of them or, with ENOMEM, none. Only not-present
    /// entries change, which no TLB caches.
    pub fn back(&mut self, start: u64, end: u64) -> Result<(), Errno> {
        let mut new = alloc::vec::Vec::new();
        let mut chunk = start & !(CHUNK - 1);
        while chunk < end {
            if !self.frames.contains_key(&chunk) {
                new.push((chunk, Frame::new(CHUNK)?));
            }
            chunk += CHUNK;
        }
        for (chunk, f) in new {
            self.set_chunk(chunk, f.addr());
            self.frames.insert(chunk, f);
        }
        Ok(())
    }

    /// Where the runtime reaches `len` bytes at `va` (aligned to `len`) of
    /// this space's memory, if it has a frame there.
    fn frame_at(&self, va: u64, len: u64) -> Option<*mut u8> {
        let (&at, f) = self.frames.range(..=va).next_back()?;
        // SAFETY: inside the frame (checked first).
        (va.is_multiple_of(len) && va + len <= at + f.size).then(|| unsafe { f.ptr().add((va - at) as usize) })
    }

    /// Write `v` at `va` in this space's memory (not the one loaded).
    pub fn write_u32(&mut self, va: u64, v: u32) -> Result<(), Errno> {
        let p = self.frame_at(va, 4).ok_or(crate::errno::EFAULT)?;
        // SAFETY: inside one of its frames (checked), aligned.
        unsafe { (p as *mut u32).write(v) };
        Ok(())
    }

    /// Replace the 16 bytes at `va` (aligned) with `new` if they hold
    /// `old`: a text rewrite made in another process (`sysjmp`).
    pub fn patch(&mut self, va: u64, old: u128, new: u128) {
        if let Some(p) = self.frame_at(va, 16) {
            // SAFETY: inside one of its frames (checked), aligned; the
            // process is not running (one vCPU: the caller is).
            unsafe {
                if (p as *const u128).read() == old {
                    (p as *mut u128).write(new);
                }
            }
        }
    }
}

/// Load the tables rooted at `root` (0: the VMM's identity tables).
///
/// # Safety
/// `root` is 0 or the root of a live [`AddressSpace`], which must stay alive
/// while loaded.
pub unsafe fn load(root: u64) {
    LOADED.store(root, Ordering::Relaxed);
    // SAFETY: every AddressSpace maps the system area and the runtime as the
    // VMM's tables do (built from them); the caller keeps it alive.
    unsafe { ftvm_rt::set_address_space(root) };
}
