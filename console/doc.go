// Package console is an operator's console for a onceflow service: an http.Handler that a
// service mounts under a path of its choice, and that `onceflow console` serves on its own. It
// shows each handler (topic, quality of service, state, rate, deliveries in flight, outcomes,
// delivery-limit hits), the dead letters (filtered, paged, one in full with its payload as
// JSON, text or hex; replayed or deleted one by one, by selection or all that match, after a
// confirmation, with a report of each one's fate) and the storage (the dedup table, the
// outbox, the last purge), from a JSON API that scripts can use too. docs/console.md shows it.
//
// Mounted in the service, it reads the handlers from the service's Router; started beside the
// service, from the database's tables, which say less. It is read-only unless Config.Authorize
// is set, refuses changes from other origins, and shows what messages carry as text. Its page
// is embedded in the binary: no CDN, no build step.
package console
