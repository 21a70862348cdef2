//! Kernel parameter structs described once: one declaration gives the Rust struct the host fills and
//! the WGSL struct the kernel reads as immediates (`#params NAME` in a shader inserts it), so the two
//! cannot drift apart field by field.

/// A kernel's immediates: plain `u32` / `i32` / `f32` fields in declaration order, 4 bytes each, so
/// the `#[repr(C)]` Rust layout and the WGSL struct layout agree without padding.
pub trait GpuParams: bytemuck::Pod {
    /// The WGSL declaration, `struct NAME { field: type, … }`.
    const WGSL: &'static str;
}

/// The scalar types a params field may have: those whose Rust and WGSL names and sizes agree.
pub trait WgslScalar {}
impl WgslScalar for u32 {}
impl WgslScalar for i32 {}
impl WgslScalar for f32 {}

/// Declares a params struct and its WGSL twin (see [`GpuParams`]): the Rust struct gets
/// `#[repr(C)]`, `Clone`, `Copy`, `Debug`, `Default`, `Pod` and `Zeroable`; the doc comments, which
/// say what the kernel does with each field, become the WGSL declaration's comments too.
#[macro_export]
macro_rules! gpu_params {
    (
        $(#[doc = $doc:literal])*
        $vis:vis struct $name:ident {
            $($(#[doc = $fdoc:literal])* $fvis:vis $field:ident : $ty:ident),* $(,)?
        }
    ) => {
        $(#[doc = $doc])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
        $vis struct $name {
            $($(#[doc = $fdoc])* $fvis $field: $ty),*
        }

        impl $crate::gpu::GpuParams for $name {
            const WGSL: &'static str = concat!(
                $("//", $doc, "\n",)*
                "struct ", stringify!($name), " {\n",
                $($("    //", $fdoc, "\n",)* "    ", stringify!($field), ": ", stringify!($ty), ",\n",)*
                "}"
            );
        }

        const _: () = {
            const fn scalar<T: $crate::gpu::params::WgslScalar>() {}
            $(scalar::<$ty>();)*
        };
    };
}
