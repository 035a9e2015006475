// Tessera console: the one behaviour pages need beyond plain HTML forms.
// A button with data-copy="ID" copies the text of element ID (a new key's secret).
document.addEventListener("click", (event) => {
  const button = event.target.closest("[data-copy]");
  if (!button) return;
  const source = document.getElementById(button.dataset.copy);
  if (!source) return;
  navigator.clipboard.writeText(source.textContent.trim()).then(
    () => { button.textContent = "Copied"; },
    () => { button.textContent = "Select and copy"; }
  );
});
