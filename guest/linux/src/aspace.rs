//! Address spaces of forked processes: the same virtual addresses as the
//! parent's, memory shared copy-on-write behind them.
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
//! map this process's frames. Everything of the runtime (code, heap,
//! kernel stacks, these tables, the frames themselves) stays identity-mapped
//! and shared, so the system-call layer runs unchanged in every process and
//! reaches the calling process's memory at the addresses the program passes,
//! and hypercall blocks and DMA buffers (runtime memory) keep meaning
//! guest-physical addresses.
//!
//! Copy-on-write, 2 MiB at a time (the region is mapped with 2 MiB
//! entries): `fork` shares every chunk of the parent's region that holds a
//! claimed page with the child, read-only in both, the frame's share count
//! being its `Arc`'s. A write to such a chunk faults; the VMM's ring-0 stub
//! reflects the fault to the runtime's CPL3 handler (`pagefault`), which
//! unshares the chunk ([`AddressSpace::unshare_chunk`]): the last sharer
//! gets write access back; process 1 keeps its own memory and moves the
//! other sharers to a copy (they are not running); any other process gets
//! a copy of its own in a free chunk. A process's end drops its shares,
//! and a chunk it leaves to one other sharer is writable there again.
//! Process 1 runs on the VMM's tables until its first fork and on an
//! identity space of its own from then on, so that what it shares can be
//! read-only for it too; its claimed chunks are its own memory, shared as
//! frames that are never given back. Image pages are still copied at fork:
//! 1-1.6 MiB for the test programs and redis-server, at 0.7 µs a page
//! about 0.2-0.3 ms of a warm fork, where sharing them would cost a fault
//! (45-130 µs) for each page the program then writes (its data and bss
//! are written at once). The runtime writes into program memory itself
//! (read() into a buffer, signal frames, wait statuses, zeroing released
//! memory, text rewrites): those paths unshare first ([`unshare`], from
//! `sys::user`'s accessors, `sys::mem` and `sysjmp`), so faults only ever
//! come from program code, never while the runtime holds a lock.
//!
//! Why a changed entry is seen without `invlpg` (which CPL3 cannot run):
//! a fork makes entries of the loaded space read-only and then loads it
//! again (ADDRESS_SPACE, a CR3 load, flushes the TLB), so no writable
//! entry survives; the unsharing writes only ever make an entry of the
//! loaded space more permissive or point it at a copy of the same bytes,
//! and a TLB entry that is still the old read-only one faults again: the
//! fault itself drops the TLB's entries for its address, and the handler,
//! finding the chunk writable already, just lets the instruction retry
//! (more than three such faults in a row at one chunk end the VM: the
//! change is never seen). Entries of spaces not loaded are reloaded with
//! them. KVM on these hosts
//! shadows the guest's tables (shadow paging) and write-protects them, so
//! a write to a loaded directory traps and updates the shadow entries (the
//! tests would see a stale frame otherwise). All of it holds because one
//! vCPU runs every thread of every process (`sched`; the Linux personality
//! refuses a second vCPU): no other CPU can hold an entry for a frame that
//! moves. With several, a moved sharer could be running elsewhere, and a
//! frame change would need that CPU to reload its tables first.
//!
//! A copy's frame is a free 2 MiB chunk of the program region that process
//! 1's allocator lends (`mm`), or, when the region has none, a block of the
//! runtime's heap (`rtmem=`). With neither, as Linux's OOM killer would, a
//! child whose write needs a copy is killed (SIGKILL: `pagefault` makes
//! it leave through a system call instead of retrying), and when process 1
//! writes, the children sharing the chunk are (they are not running, and
//! leave at the end of the system call they are in); a system call that
//! writes into shared memory gets ENOMEM. Every space made here maps the
//! whole region a second time at [`WINDOW`], where the runtime reaches any
//! frame whatever tables are loaded ([`reach`]). Everything lives in
//! guest RAM and the vCPU's CR3 (the fault handler's registration too), so
//! checkpoints and failover carry processes like any other state.
//!
//! Measured (guest/README.md, `fork bench`, `--memory 2048`): a fork of a
//! parent with 16 MiB to 1 GiB touched takes 0.6-2.7 ms when its runtime
//! memory was used before (4-10 ms the first time), against 37-57 ms
//! natively on the host for 1 GiB (4 KiB pages) and 0.8-1.1 ms with
//! transparent huge pages; a write fault resolved without a copy 44-134
//! µs, one that copies 2 MiB 0.27-0.66 ms into memory used before and 4-22
//! ms into memory never touched (a host and a shadow page fault per 4 KiB
//! page); an address-space switch 43-131 µs.

use alloc::alloc::{alloc_zeroed, dealloc};
use alloc::boxed::Box;
use alloc::collections::BTreeMap;
use alloc::sync::Arc;
use core::alloc::Layout;
use core::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

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
    /// Process 1's own memory at this address (its identity map), shared
    /// with its children: never given back (process 1's allocator owns it).
    Identity,
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

    /// Process 1's chunk at `va`, its own memory, as a frame to share.
    fn identity(va: u64) -> Frame {
        Frame { addr: va, size: CHUNK, from: Source::Identity }
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
            Source::Region | Source::Identity => reach(self.addr),
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
            Source::Identity => {}
        }
    }
}

// SAFETY: a Frame owns its memory; the runtime runs on one vCPU.
unsafe impl Send for Frame {}

/// Read-only chunk entries in all address spaces: while there are none, no
/// write of the runtime into program memory has to check for sharing.
static READ_ONLY: AtomicUsize = AtomicUsize::new(0);

pub struct AddressSpace {
    pml4: Box<Table>,
    pdpt: Box<Table>,
    /// Page directories of their own, by GiB.
    pds: BTreeMap<u64, Box<Table>>,
    /// Page tables of their own, by the 2 MiB chunk they map.
    pts: BTreeMap<u64, Box<Table>>,
    /// The image's pages, copied at fork, by virtual address.
    pages: BTreeMap<u64, Frame>,
    /// The region's chunks that have frames, by virtual address; shared
    /// with other processes (and then mapped read-only) after a fork.
    chunks: BTreeMap<u64, Arc<Frame>>,
    /// Process 1's space: its region is its own identity-mapped memory,
    /// which it keeps (`chunks` holds only the chunks it shares).
    identity: bool,
    /// Its read-only chunk entries (its part of [`READ_ONLY`]).
    read_only: usize,
}

impl AddressSpace {
    /// The VMM's identity map, in tables of our own.
    fn new(identity: bool) -> AddressSpace {
        let mut pml4 = Table::copy_of(PAGE_TABLE_ROOT);
        let pdpt = Table::copy_of(pml4.0[0] & PTE_ADDR);
        pml4.0[0] = pdpt.addr() | USER;
        pml4.0[1] = WINDOW_TABLES.get().expect("aspace::init ran at start").pdpt.addr() | USER;
        AddressSpace {
            pml4,
            pdpt,
            pds: BTreeMap::new(),
            pts: BTreeMap::new(),
            pages: BTreeMap::new(),
            chunks: BTreeMap::new(),
            identity,
            read_only: 0,
        }
    }

    /// Process 1's tables from its first fork on: the VMM's identity map,
    /// in tables of our own so that chunks it shares can be read-only.
    pub fn identity() -> AddressSpace {
        AddressSpace::new(true)
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

    /// Map the 2 MiB chunk at `va` to `frame` (0: nothing), writable or not.
    fn set_chunk(&mut self, va: u64, frame: u64, writable: bool) {
        let entry = match (frame, writable) {
            (0, _) => 0,
            (_, true) => frame | USER | PTE_LARGE,
            (_, false) => frame | PTE_PRESENT | PTE_USER | PTE_LARGE,
        };
        let slot = &mut self.pd(va).0[Self::pd_index(va)];
        let was_ro = *slot & (PTE_PRESENT | PTE_WRITE) == PTE_PRESENT;
        *slot = entry;
        let is_ro = frame != 0 && !writable;
        if was_ro != is_ro {
            if is_ro {
                self.read_only += 1;
                READ_ONLY.fetch_add(1, Ordering::Relaxed);
            } else {
                self.read_only -= 1;
                READ_ONLY.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }

    fn writable(&mut self, va: u64) -> bool {
        self.pd(va).0[Self::pd_index(va)] & PTE_WRITE != 0
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

    /// A child of the calling process, whose space `parent` is (loaded
    /// now): `image` pages copied one by one, and in `region` (2 MiB
    /// aligned) every chunk holding a `used` range shared, read-only in
    /// both (copy-on-write, [`unshare_chunk`](Self::unshare_chunk)); the
    /// region's other chunks are left unmapped until [`back`](Self::back).
    /// The caller reloads the parent's tables afterwards: entries that were
    /// writable are not any more, and a TLB may still hold them.
    pub fn fork(parent: &mut AddressSpace, image: (u64, u64), region: (u64, u64), used: &[(u64, u64)]) -> Result<AddressSpace, Errno> {
        let mut a = AddressSpace::new(false);
        let mut page = image.0 & !(PAGE - 1);
        while page < image.1 {
            let f = Frame::new(PAGE)?;
            // SAFETY: `page` is a page of the program's image, mapped in the
            // calling process; the frame is a fresh page no one else uses.
            unsafe { core::ptr::copy_nonoverlapping(page as *const u8, f.ptr(), PAGE as usize) };
            a.set_page(page, f.addr());
            a.pages.insert(page, f);
            page += PAGE;
        }
        let mut chunk = region.0;
        while chunk < region.1 {
            a.set_chunk(chunk, 0, false);
            chunk += CHUNK;
        }
        for &(start, end) in used {
            let mut chunk = start & !(CHUNK - 1);
            while chunk < end {
                if !a.chunks.contains_key(&chunk) {
                    let f = match parent.chunks.get(&chunk) {
                        Some(f) => f.clone(),
                        None if parent.identity => {
                            let f = Arc::new(Frame::identity(chunk));
                            parent.chunks.insert(chunk, f.clone());
                            f
                        }
                        // Claimed memory of a forked process has a frame.
                        None => return Err(crate::errno::EFAULT),
                    };
                    parent.set_chunk(chunk, f.addr(), false);
                    a.set_chunk(chunk, f.addr(), false);
                    a.chunks.insert(chunk, f);
                }
                chunk += CHUNK;
            }
        }
        Ok(a)
    }

    /// Give every chunk of region memory `[start, end)` a (zeroed) frame if
    /// it has none; all of them or, with ENOMEM, none. Only not-present
    /// entries change, which no TLB caches. Nothing to do in process 1,
    /// whose region is its memory.
    pub fn back(&mut self, start: u64, end: u64) -> Result<(), Errno> {
        if self.identity {
            return Ok(());
        }
        let mut new = alloc::vec::Vec::new();
        let mut chunk = start & !(CHUNK - 1);
        while chunk < end {
            if !self.chunks.contains_key(&chunk) {
                new.push((chunk, Frame::new(CHUNK)?));
            }
            chunk += CHUNK;
        }
        for (chunk, f) in new {
            self.set_chunk(chunk, f.addr(), true);
            self.chunks.insert(chunk, Arc::new(f));
        }
        Ok(())
    }

    /// Make the chunk at `va` writable for this process if it is a shared
    /// read-only one: Ok(false) if it is not one of its chunks at all. The
    /// last sharer just gets write access back; process 1 keeps its own
    /// memory and moves the other sharers to a copy (they are not running:
    /// one vCPU); any other process gets a copy of its own. Only entries of
    /// this space that were read-only change (a stale TLB entry faults
    /// again and finds the chunk writable), and entries of spaces not
    /// loaded, which the next switch reloads.
    pub fn unshare_chunk(&mut self, va: u64) -> Result<bool, Errno> {
        let Some(shared) = self.chunks.get(&va).cloned() else { return Ok(false) };
        if self.writable(va) {
            return Ok(true);
        }
        if Arc::strong_count(&shared) == 2 {
            // Ours and the clone just made: the last sharer.
            self.set_chunk(va, shared.addr(), true);
            if self.identity && shared.addr() == va {
                self.chunks.remove(&va);
            }
            return Ok(true);
        }
        let copy = match Frame::chunk() {
            Ok(f) => Arc::new(f),
            Err(_) if self.identity && shared.addr() == va => {
                // No memory for the others' copy: they are killed, as
                // Linux's OOM killer would, and process 1 writes its own
                // memory. They never run program code again (a killed
                // thread leaves at the end of the system call it is in).
                kill_sharers(va, &shared);
                self.chunks.remove(&va);
                self.set_chunk(va, va, true);
                return Ok(true);
            }
            Err(e) => return Err(e),
        };
        // SAFETY: two distinct 2 MiB frames, reached where `ptr` says;
        // the copy is fresh and no one else maps it yet.
        unsafe { core::ptr::copy_nonoverlapping(shared.ptr(), copy.ptr(), CHUNK as usize) };
        if self.identity && shared.addr() == va {
            move_sharers(va, &shared, &copy);
            self.chunks.remove(&va);
            self.set_chunk(va, va, true);
        } else {
            self.set_chunk(va, copy.addr(), true);
            self.chunks.insert(va, copy);
        }
        Ok(true)
    }

    /// Where the runtime reaches `len` bytes at `va` (aligned to `len`) of
    /// this space's memory, if it has a frame there.
    fn frame_at(&self, va: u64, len: u64) -> Option<*mut u8> {
        let chunk = self.chunks.get(&(va & !(CHUNK - 1))).map(|f| (va & !(CHUNK - 1), &**f));
        let (at, f) = chunk.or_else(|| self.pages.range(..=va).next_back().map(|(&a, f)| (a, f)))?;
        // SAFETY: inside the frame (checked first).
        (va.is_multiple_of(len) && va + len <= at + f.size).then(|| unsafe { f.ptr().add((va - at) as usize) })
    }

    /// Write `v` at `va` in this space's memory (not the one loaded), as
    /// a write of this process: a shared chunk is unshared first.
    pub fn write_u32(&mut self, va: u64, v: u32) -> Result<(), Errno> {
        self.unshare_chunk(va & !(CHUNK - 1))?;
        let p = self.frame_at(va, 4).ok_or(crate::errno::EFAULT)?;
        // SAFETY: inside one of its frames (checked), aligned.
        unsafe { (p as *mut u32).write(v) };
        Ok(())
    }

    /// Replace the 16 bytes at `va` (aligned) with `new` if they hold
    /// `old`: a text rewrite made in another process (`sysjmp`). Shared
    /// text is patched for every sharer at once, which is what a rewrite
    /// made everywhere wants. False in process 1's space, whose memory is
    /// reached at its own addresses under the VMM's tables.
    pub fn patch(&mut self, va: u64, old: u128, new: u128) -> bool {
        if self.identity {
            return false;
        }
        if let Some(p) = self.frame_at(va, 16) {
            // SAFETY: inside one of its frames (checked), aligned; the
            // process is not running (one vCPU: the caller is).
            unsafe {
                if (p as *const u128).read() == old {
                    (p as *mut u128).write(new);
                }
            }
        }
        true
    }
}

impl AddressSpace {
    /// An ended process's space goes: its frames go back (zeroed) unless
    /// others share them, and a chunk it shared with one other process
    /// alone is made writable there again. That saves the survivor (a
    /// BGSAVE's parent) a fault per chunk, and every write of the runtime
    /// into its memory the check for shared chunks ([`unshare`]). Called
    /// when the space is not loaded (`sched`).
    pub fn release(mut self) {
        let chunks = core::mem::take(&mut self.chunks);
        drop(self);
        let pairs: alloc::vec::Vec<(u64, Arc<Frame>)> = chunks.into_iter().filter(|(_, f)| Arc::strong_count(f) == 2).collect();
        if pairs.is_empty() {
            return;
        }
        for p in crate::process::all() {
            let mut guard = p.space.lock();
            let Some(space) = guard.as_mut() else { continue };
            for (va, f) in &pairs {
                if space.chunks.get(va).is_some_and(|g| Arc::ptr_eq(g, f)) {
                    space.set_chunk(*va, f.addr(), true);
                    if space.identity && f.addr() == *va {
                        space.chunks.remove(va);
                    }
                }
            }
        }
    }
}

impl Drop for AddressSpace {
    fn drop(&mut self) {
        READ_ONLY.fetch_sub(self.read_only, Ordering::Relaxed);
    }
}

/// Process 1 writes its chunk at `va` (its own memory, `shared`), which
/// other processes share: move each of them to `copy`, read-only if
/// several still share it.
fn move_sharers(va: u64, shared: &Arc<Frame>, copy: &Arc<Frame>) {
    let me = crate::sched::current_process().pid;
    let mut moved = alloc::vec::Vec::new();
    for p in crate::process::all() {
        if p.pid == me {
            continue;
        }
        let mut guard = p.space.lock();
        let Some(space) = guard.as_mut() else { continue };
        if space.chunks.get(&va).is_some_and(|f| Arc::ptr_eq(f, shared)) {
            space.set_chunk(va, copy.addr(), false);
            space.chunks.insert(va, copy.clone());
            drop(guard);
            moved.push(p);
        }
    }
    if let [only] = moved.as_slice() {
        if let Some(space) = only.space.lock().as_mut() {
            space.set_chunk(va, copy.addr(), true);
        }
    }
}

/// The processes but the calling one (process 1) that share its chunk at
/// `va`: killed (SIGKILL), there being no memory for their copy.
fn kill_sharers(va: u64, shared: &Arc<Frame>) {
    let me = crate::sched::current_process().pid;
    for p in crate::process::all() {
        let shares = p.pid != me
            && p.ending().is_none()
            && p.space.lock().as_ref().is_some_and(|s| s.chunks.get(&va).is_some_and(|f| Arc::ptr_eq(f, shared)));
        if shares && crate::process::signal(p.pid, crate::process::SIGKILL) == Ok(crate::process::Sent::Ends) {
            ftvm_rt::println!("linux: out of memory for a copy-on-write copy: process {} killed", p.pid);
            crate::sched::wake_process(p.pid);
        }
    }
}

/// What [`write_fault`] found.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Fault {
    /// A write to a chunk the process shared, writable now.
    Resolved,
    /// The chunk was writable already: the TLB held an older entry, which
    /// the fault dropped.
    Stale,
    /// A copy-on-write fault with no memory left for the copy.
    NoMemory,
    /// Not a copy-on-write fault.
    NotOurs,
}

/// A write fault at `addr` in the calling process's program code; the
/// program retries the instruction unless it was [`Fault::NotOurs`].
pub fn write_fault(addr: u64) -> Fault {
    let p = crate::sched::current_process();
    let mut guard = p.space.lock();
    let Some(space) = guard.as_mut() else { return Fault::NotOurs };
    let va = addr & !(CHUNK - 1);
    if space.chunks.contains_key(&va) && space.writable(va) {
        return Fault::Stale;
    }
    match space.unshare_chunk(va) {
        Ok(true) => Fault::Resolved,
        Ok(false) => Fault::NotOurs,
        Err(_) => Fault::NoMemory,
    }
}

/// Make `[start, start + len)` of the calling process's memory writable
/// for the runtime, which writes into program memory (read() into a
/// buffer, signal frames, wait statuses, zeroing released memory): a
/// fault must never come from the runtime, which may hold locks then. The
/// caller holds none that this takes (the scheduler's, process 1's memory
/// allocator's, the process table's, address spaces').
pub fn unshare(start: u64, len: u64) -> Result<(), Errno> {
    if READ_ONLY.load(Ordering::Relaxed) == 0 || len == 0 {
        return Ok(());
    }
    let p = crate::sched::current_process();
    let mut guard = p.space.lock();
    let Some(space) = guard.as_mut() else { return Ok(()) };
    if space.read_only == 0 {
        return Ok(());
    }
    let end = start.saturating_add(len);
    let mut at = start & !(CHUNK - 1);
    while at < end {
        let Some(&va) = space.chunks.range(at..end).next().map(|(va, _)| va) else { break };
        space.unshare_chunk(va)?;
        at = va + CHUNK;
    }
    Ok(())
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
