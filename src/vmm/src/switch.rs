//! Switches: small enums named on the command line (`--capture pause`,
//! `--dirty-backend ring`), defined once here for this crate and the
//! replication crate.

/// An enum whose values parse from and print as their command-line names;
/// `VALUES` lists them (for help texts and the ablation benchmark). The
/// first value is the default. The enum derives serde's traits, so the
/// crate using the macro depends on `serde` (with `derive`).
#[macro_export]
macro_rules! switch {
    (
        $(#[$meta:meta])*
        pub enum $name:ident {
            $(#[doc = $first_doc:literal])* $first:ident = $first_text:literal,
            $($(#[doc = $doc:literal])* $variant:ident = $text:literal,)*
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ::serde::Serialize, ::serde::Deserialize)]
        pub enum $name {
            $(#[doc = $first_doc])*
            #[default]
            $first,
            $($(#[doc = $doc])* $variant,)*
        }

        impl $name {
            pub const VALUES: &'static [&'static str] = &[$first_text, $($text),*];
        }

        impl ::std::str::FromStr for $name {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                match s {
                    $first_text => Ok($name::$first),
                    $($text => Ok($name::$variant),)*
                    _ => Err(format!("unknown value '{s}' (expected {})", Self::VALUES.join(" or "))),
                }
            }
        }

        impl ::std::fmt::Display for $name {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(match self {
                    $name::$first => $first_text,
                    $($name::$variant => $text,)*
                })
            }
        }
    };
}

#[cfg(test)]
mod tests {
    crate::switch! {
        /// Test switch.
        pub enum Colour {
            /// The first.
            Red = "red",
            Light = "light-blue",
        }
    }

    #[test]
    fn names_round_trip() {
        assert_eq!(Colour::default(), Colour::Red);
        for v in Colour::VALUES {
            assert_eq!(v.parse::<Colour>().unwrap().to_string(), *v);
        }
        assert_eq!("green".parse::<Colour>().unwrap_err(), "unknown value 'green' (expected red or light-blue)");
    }
}
