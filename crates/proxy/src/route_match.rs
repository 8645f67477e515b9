//! A route's `match`: an HTTP method and path pattern, a gRPC method (or an HTTP path of any
//! method), or every method of a gRPC service; parsed and checked as the library's table
//! keys it.

use http::Method;

/// What a route applies to, as the library's table keys it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouteMatch {
    /// An HTTP method and path pattern.
    Route(Method, String),
    /// One path, any method: a gRPC method or an HTTP path without parameters.
    Path(String),
    /// Every method of a gRPC service.
    Service(String),
}

impl std::fmt::Display for RouteMatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RouteMatch::Route(method, pattern) => write!(f, "{method} {pattern}"),
            RouteMatch::Path(path) => f.write_str(path),
            RouteMatch::Service(service) => write!(f, "/{service}/*"),
        }
    }
}

impl RouteMatch {
    /// Parses a `match` text.
    pub fn parse(text: &str) -> Result<RouteMatch, String> {
        let text = text.trim();
        if let Some((method, pattern)) = text.split_once(char::is_whitespace) {
            let method = Method::from_bytes(method.as_bytes())
                .map_err(|_| format!("{method:?} is not an HTTP method"))?;
            let pattern = pattern.trim();
            check_path(pattern)?;
            return Ok(RouteMatch::Route(method, pattern.to_owned()));
        }
        check_path(text)?;
        if let Some(service) = text
            .strip_prefix('/')
            .and_then(|rest| rest.strip_suffix("/*"))
        {
            if service.is_empty() || service.contains('/') {
                return Err(format!(
                    "{text:?}: a gRPC service is written /pkg.Service/*"
                ));
            }
            return Ok(RouteMatch::Service(service.to_owned()));
        }
        if text.contains('{') {
            return Err(format!(
                "{text:?} has parameters: name the HTTP method too (`POST {text}`)"
            ));
        }
        Ok(RouteMatch::Path(text.to_owned()))
    }
}

fn check_path(path: &str) -> Result<(), String> {
    if !path.starts_with('/') {
        return Err(format!("{path:?} must start with /"));
    }
    if path.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!("{path:?} holds a space or a control character"));
    }
    for segment in path.split('/') {
        let opens = segment.matches('{').count();
        let closes = segment.matches('}').count();
        let whole = segment.starts_with('{') && segment.ends_with('}') && opens == 1;
        if (opens > 0 || closes > 0) && !(whole && closes == 1 && segment.len() > 2) {
            return Err(format!(
                "{path:?}: a parameter is a whole segment, `{{name}}`"
            ));
        }
    }
    Ok(())
}
