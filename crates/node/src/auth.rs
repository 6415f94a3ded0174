//! Who may call the node's REST API (plain HTTP on the API port). Every
//! route needs an API token (`Authorization: Bearer shoal-...`) that the
//! directory knows and that has not expired, of a role that allows the
//! call: reading (GET, `/metrics`) needs a read-only or admin token,
//! anything that changes state an admin token (so `GET
//! /v1/cluster/settings` is read-only, `POST /v1/cluster/settings` admin);
//! a join token opens nothing here. Open without a token: `/livez` (liveness probes, and a joining
//! node learning the cluster's id). The routes nodes call on each other
//! are not on plain HTTP at all: see [`crate::api_server`].
//! Owns the decision only; tokens are made and revoked through the
//! directory.

use crate::http::Http;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use shoal_model::{Role, TokenText};

/// What a call needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Open,
    Needs(Role),
}

/// The access a call to `path` with `method` needs.
pub fn needed(method: &Method, path: &str) -> Access {
    if path == "/livez" {
        return Access::Open;
    }
    if method == Method::GET || method == Method::HEAD {
        Access::Needs(Role::ReadOnly)
    } else {
        Access::Needs(Role::Admin)
    }
}

/// The token text a request presents, if any.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
        .map(str::trim)
}

fn refuse(status: StatusCode, msg: String) -> Response {
    (status, axum::Json(shoal_api::ErrorBody { error: msg })).into_response()
}

/// The middleware: passes the request on, or answers 401/403 with why.
pub async fn require(State(h): State<Http>, req: Request, next: Next) -> Response {
    let Access::Needs(role) = needed(req.method(), req.uri().path()) else {
        return next.run(req).await;
    };
    let Some(text) = bearer(req.headers()) else {
        return refuse(
            StatusCode::UNAUTHORIZED,
            "this API needs a token: pass --token or SHOAL_TOKEN (a local cluster's \
             admin token is DATA/admin.token)"
                .into(),
        );
    };
    let Ok(t) = text.parse::<TokenText>() else {
        return refuse(StatusCode::UNAUTHORIZED, "not a Shoal API token".into());
    };
    let state = h.router.dir.state();
    let Some(known) = state.tokens.get(&t.id).filter(|k| t.proves(k)) else {
        return refuse(
            StatusCode::UNAUTHORIZED,
            format!("token {} is not valid here (unknown or revoked)", t.id),
        );
    };
    if known.expired(crate::membership::now_unix_s()) {
        return refuse(
            StatusCode::UNAUTHORIZED,
            format!("token {} has expired", t.id),
        );
    }
    if !known.role.allows(role) {
        return refuse(
            StatusCode::FORBIDDEN,
            format!(
                "token {} has the {} role: this needs the {role} role",
                t.id, known.role
            ),
        );
    }
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_need_read_only_changes_need_admin() {
        assert_eq!(needed(&Method::GET, "/livez"), Access::Open);
        assert_eq!(
            needed(&Method::GET, "/v1/volumes"),
            Access::Needs(Role::ReadOnly)
        );
        assert_eq!(
            needed(&Method::GET, "/metrics"),
            Access::Needs(Role::ReadOnly)
        );
        assert_eq!(
            needed(&Method::POST, "/v1/volumes"),
            Access::Needs(Role::Admin)
        );
        assert_eq!(
            needed(&Method::DELETE, "/v1/volumes/x"),
            Access::Needs(Role::Admin)
        );
        assert_eq!(
            needed(&Method::POST, "/v1/scrub"),
            Access::Needs(Role::Admin)
        );
        assert_eq!(
            needed(&Method::GET, "/v1/cluster/settings"),
            Access::Needs(Role::ReadOnly)
        );
        assert_eq!(
            needed(&Method::POST, "/v1/cluster/settings"),
            Access::Needs(Role::Admin)
        );
        let mut h = HeaderMap::new();
        assert_eq!(bearer(&h), None);
        h.insert(header::AUTHORIZATION, "Bearer shoal-x".parse().unwrap());
        assert_eq!(bearer(&h), Some("shoal-x"));
    }
}
