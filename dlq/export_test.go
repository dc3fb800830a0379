package dlq

// NormalizeError exposes the error-text normaliser behind
// Entry.Fingerprint to the package's external tests.
var NormalizeError = normalizeError
